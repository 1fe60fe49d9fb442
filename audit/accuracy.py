"""Scores an mlperf_log_accuracy.json exactly as the reference's evaluation.py does, and writes accuracy.txt.

Official metric: micro hierarchical F1 of the category; brand score and is_secondhand F1 are informational.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from decimal import Decimal
from pathlib import Path

import numpy as np
from pydantic import ValidationError
from rapidfuzz import fuzz
from sklearn.metrics import f1_score

from contract.dataset import DATASETS, GroundTruth, load_catalogue
from contract.prompt import ProductMetadata

logger = logging.getLogger(__name__)

CATEGORY_SEPARATOR = " > "
PRED_CATEGORY_PAD = "<|__PRED_CATEGORY_PAD__|>"
PRED_BRAND_PAD = "<|__PRED_BRAND_PAD__|>"
BRAND_MATCH_THRESHOLD = 90  # fuzz.ratio strictly above this is a match
RANDOM_SEED = 12345  # the reference CLI's default random_seed
# The reference splits the log into min(cpu_count, 4) chunks, each with its own RNG; that decides the random
# is_secondhand given to unparsable responses. We fix the chunk count at 4 so the score is machine-independent.
REFERENCE_CHUNKS = 4
TARGETS: dict[str, float] = {
    "offline": 0.7903 * 0.99,
    "server": 0.7903 * 0.99,
    "interactive": 0.7878 * 0.99,
}


@dataclass(frozen=True)
class AccuracyResult:
    category_f1: float  # the official metric
    hierarchical_precision: float
    hierarchical_recall: float
    brand_score: float
    is_secondhand_f1: float
    num_responses: int
    num_unparsable: int
    random_category_f1: float
    random_brand_score: float
    random_is_secondhand_f1: float

    def target(self, scenario: str) -> float:
        try:
            return TARGETS[scenario.lower()]
        except KeyError:
            raise ValueError(f"unknown scenario {scenario!r}; expected one of {sorted(TARGETS)}") from None

    def passes(self, scenario: str) -> bool:
        return self.category_f1 >= self.target(scenario)


@dataclass(frozen=True)
class LogEntry:
    seq_id: int
    qsl_idx: int
    data: bytes


def hierarchical_components(predicted: str, truth: str, sep: str = CATEGORY_SEPARATOR) -> tuple[int, int, int]:
    """(common-prefix length, predicted depth, true depth) of two " > " paths, levels stripped."""
    pred = [c.strip() for c in predicted.split(sep)]
    true = [c.strip() for c in truth.split(sep)]
    common = 0
    for p, t in zip(pred, true):
        if p != t:
            break
        common += 1
    return common, len(pred), len(true)


def hierarchical_f1(pairs: Sequence[tuple[str, str]]) -> tuple[float, float, float]:
    """Micro-aggregated (F1, hP, hR) over (predicted, true) category pairs."""
    inter = n_pred = n_true = 0
    for predicted, truth in pairs:
        i, p, t = hierarchical_components(predicted, truth)
        inter, n_pred, n_true = inter + i, n_pred + p, n_true + t
    hp = inter / n_pred if n_pred else 0.0
    hr = inter / n_true if n_true else 0.0
    f1 = 0.0 if hp + hr == 0 else 2 * hp * hr / (hp + hr)
    return f1, hp, hr


def brand_score(pairs: Sequence[tuple[str, str]]) -> float:
    """Share of (predicted, true) brands whose lower-cased fuzz.ratio exceeds 90."""
    if not pairs:
        return 0.0
    hits = sum(fuzz.ratio(t.strip().lower(), p.strip().lower()) > BRAND_MATCH_THRESHOLD for p, t in pairs)
    return hits / len(pairs)


def secondhand_f1(pairs: Sequence[tuple[bool, bool]]) -> float:
    if not pairs:
        return 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return float(f1_score([t for _, t in pairs], [p for p, _ in pairs]))


def parse_response(data: bytes) -> ProductMetadata | None:
    """The response as the reference parses it; None if it is not exactly a ProductMetadata JSON object."""
    try:
        return ProductMetadata.model_validate_json(data.decode("utf-8"))
    except (ValidationError, UnicodeDecodeError):
        return None


def read_accuracy_log(path: str | Path) -> list[LogEntry]:
    """LoadGen's accuracy log: a JSON list of {seq_id, qsl_idx, data: upper-case hex of the response}."""
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    if not isinstance(raw, list):
        raise ValueError(f"{path}: expected a JSON list of LoadGen accuracy entries")
    entries = []
    for k, item in enumerate(raw):
        try:
            entries.append(LogEntry(int(item["seq_id"]), int(item["qsl_idx"]), bytes.fromhex(item["data"])))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: entry {k} is not a LoadGen accuracy record ({exc})") from exc
    return entries


def evaluate(entries: Sequence[LogEntry], ground_truth: Sequence[GroundTruth], seed: int = RANDOM_SEED,
             chunks: int = REFERENCE_CHUNKS) -> AccuracyResult:
    """Scores every entry (repeated qsl_idx entries all count), consuming random numbers as the reference."""
    master = np.random.default_rng(seed=seed)
    chunk_size = max(len(entries) // chunks, 1)
    parts = [entries[i:i + chunk_size] for i in range(0, len(entries), chunk_size)]
    seeds = master.integers(0, 2**32, size=len(parts))
    category, rand_category, secondhand, rand_secondhand, brand = [], [], [], [], []
    brands: set[str] = set()
    unparsable = 0
    for part, part_seed in zip(parts, seeds):
        rng = np.random.default_rng(part_seed)
        for entry in part:
            if not 0 <= entry.qsl_idx < len(ground_truth):
                raise ValueError(f"accuracy log entry seq_id={entry.seq_id} has qsl_idx {entry.qsl_idx} "
                                 f"outside the dataset ({len(ground_truth)} samples)")
            gt = ground_truth[entry.qsl_idx]
            brands.add(gt.brand)
            pred = parse_response(entry.data)
            if pred is None:
                unparsable += 1
                logger.debug("unparsable response for sample %d: %r", entry.qsl_idx, entry.data[:200])
                depth = len(gt.category.split(CATEGORY_SEPARATOR))
                pred = ProductMetadata(category=CATEGORY_SEPARATOR.join([PRED_CATEGORY_PAD] * depth),
                                       brand=PRED_BRAND_PAD,
                                       is_secondhand=rng.choice([True, False], size=1).tolist()[0])
            category.append((pred.category, gt.category))
            secondhand.append((pred.is_secondhand, gt.is_secondhand))
            brand.append((pred.brand, gt.brand))
            rand_category.append((str(rng.choice(gt.categories)) if gt.categories else "", gt.category))
            rand_secondhand.append((bool(rng.choice([True, False])), gt.is_secondhand))
    # The reference draws from list(set(brands)), whose order varies between processes; sorted is stable.
    rand_brands = master.choice(sorted(brands), size=len(entries)) if entries else []
    f1, hp, hr = hierarchical_f1(category)
    if unparsable:
        logger.warning("%d of %d responses do not match the ProductMetadata schema", unparsable, len(entries))
    return AccuracyResult(
        category_f1=f1,
        hierarchical_precision=hp,
        hierarchical_recall=hr,
        brand_score=brand_score(brand),
        is_secondhand_f1=secondhand_f1(secondhand),
        num_responses=len(entries),
        num_unparsable=unparsable,
        random_category_f1=hierarchical_f1(rand_category)[0],
        random_brand_score=brand_score([(str(p), gt.brand) for p, gt in
                                        zip(rand_brands, (ground_truth[e.qsl_idx] for e in entries))]),
        random_is_secondhand_f1=secondhand_f1(rand_secondhand),
    )


def evaluate_accuracy_log(log_path: str | Path, catalogue, seed: int = RANDOM_SEED) -> AccuracyResult:
    """Scores LoadGen's accuracy log against a catalogue (contract.dataset.Catalogue or its ground_truth())."""
    ground_truth = catalogue.ground_truth() if hasattr(catalogue, "ground_truth") else catalogue
    return evaluate(read_accuracy_log(log_path), ground_truth, seed=seed)


def fixed_point(value: float) -> str:
    """`value` in positional notation with the digits of its repr (6.9e-06 -> "0.0000069").

    The checker reads F1 with the digits-and-dots pattern `ACC_PATTERN["F1_HIERARCHICAL"]` (audit.rules.rounds
    ACCURACY_F1_PATTERN; https://github.com/mlcommons/inference/blob/master/tools/submission/submission_checker/
    constants.py): it would read json.dumps' 6.9e-06 as 6.9.
    """
    return format(Decimal(repr(float(value))), "f")


def accuracy_txt(result: AccuracyResult) -> str:
    """accuracy.txt as the reference writes it (no newline after the hash; truncate_accuracy_log appends),
    with the F1 in positional notation so the checker's pattern reads the number that is written."""
    data = '{"f1": %s}' % fixed_point(result.category_f1)
    digest = hashlib.sha256(data.encode()).hexdigest()
    return f"Results\n\n{data}\n\nhash={digest}"


def write_accuracy_txt(result: AccuracyResult, path: str | Path) -> Path:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(accuracy_txt(result), encoding="utf-8")
    os.replace(tmp, path)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m audit.accuracy", description=__doc__)
    parser.add_argument("--log", required=True, type=Path, help="mlperf_log_accuracy.json")
    parser.add_argument("--dataset", required=True, type=Path, help="catalogue directory (holds data/*.parquet)")
    parser.add_argument("--dataset-kind", default="product-catalogue", choices=sorted(DATASETS))
    parser.add_argument("--out", type=Path, help="write accuracy.txt here")
    parser.add_argument("--scenario", choices=sorted(TARGETS), help="exit 1 unless the F1 meets its target")
    parser.add_argument("--seed", type=int, default=RANDOM_SEED)
    args = parser.parse_args(argv)
    result = evaluate_accuracy_log(args.log, load_catalogue(args.dataset, args.dataset_kind), seed=args.seed)
    report = asdict(result)
    if args.scenario:
        report |= {"scenario": args.scenario, "target": result.target(args.scenario),
                   "passed": result.passes(args.scenario)}
    print(json.dumps(report, indent=2))
    if args.out:
        write_accuracy_txt(result, args.out)
    return 0 if not args.scenario or result.passes(args.scenario) else 1


if __name__ == "__main__":
    sys.exit(main())
