"""A synthetic product catalogue written in the hub's on-disk layout, deterministic by seed.

Profiles: `small` (tiny images of every format/mode, fast), `mixed` (adds multi-megapixel images),
`realistic` (all JPEG, image sizes and text lengths drawn from the real dataset's statistics).
`bad_samples` plants faulty rows at chosen indices (fault tests); without it the output is unchanged.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import pickle
import random
import struct
import subprocess
import sys
import tempfile
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageDraw

from contract.dataset import COLUMNS, DATASETS, DatasetKind

logger = logging.getLogger(__name__)

Profile = Literal["small", "mixed", "realistic"]
PROFILES: tuple[str, ...] = ("small", "mixed", "realistic")
BadSample = Literal["undecodable", "empty_image", "bomb", "cmyk", "16bit", "long_prompt", "bad_utf8"]
BAD_SAMPLES: tuple[str, ...] = ("undecodable", "empty_image", "bomb", "cmyk", "16bit", "long_prompt", "bad_utf8")
BOMB_SIDE = 30_000  # a 30,000 x 30,000 PNG: 900 Mpixel, about 110 KB on disk
LONG_PROMPT_CHARS = 200_000  # tens of thousands of tokens, beyond any max_model_len we configure
BAD_UTF8_MARK = "\x00BAD-UTF8\x00"  # replaced by invalid UTF-8 bytes in the written parquet
ROW_GROUP_SIZE = 8
# Samples are drawn in worker processes from this many on (a realistic one takes ~33 ms, mostly its JPEG; 2,000 of
# them took ~70 s in one process); fewer are not worth the workers' start.
PARALLEL_FROM_SAMPLES = 256
MAX_WORKERS = 16
TRAIN_FRACTION = 0.8

# A small taxonomy: every root-to-node path is a category ("A > B > C").
TAXONOMY: dict[str, dict] = {
    "Apparel & Accessories": {
        "Clothing": {"Shirts & Tops": {"Polo Shirts": {}, "T-Shirts": {}, "Blouses": {}},
                     "Pants": {"Jeans": {}, "Chinos": {}}, "Men's Outerwear": {"Coats": {}, "Jackets": {}}},
        "Jewelry": {"Necklaces": {}, "Rings": {}, "Watches": {}},
        "Shoes": {"Sneakers": {}, "Boots": {}},
    },
    "Home & Garden": {
        "Kitchen & Dining": {"Cookware": {"Frying Pans": {}, "Stock Pots": {}}, "Tableware": {"Mugs": {}}},
        "Decor": {"Candles": {}, "Vases": {}, "Wall Art": {"Posters": {}, "Canvas Prints": {}}},
        "Lawn & Garden": {"Gardening Tools": {"Pruners": {}, "Trowels": {}}, "Planters": {}},
    },
    "Health & Beauty": {
        "Personal Care": {"Cosmetics": {"Skin Care": {"Moisturizers": {}, "Serums": {}}, "Makeup": {"Lipstick": {}}},
                          "Hair Care": {"Shampoo": {}, "Hair Oils": {}}},
        "Health Care": {"Vitamins & Supplements": {}, "First Aid": {}},
    },
    "Sporting Goods": {
        "Outdoor Recreation": {"Camping & Hiking": {"Tents": {}, "Backpacks": {}}, "Cycling": {"Bike Helmets": {}}},
        "Athletics": {"Yoga & Pilates": {"Yoga Mats": {}}, "Team Sports": {"Soccer Balls": {}}},
    },
    "Toys & Games": {"Toys": {"Building Toys": {}, "Dolls & Playsets": {}, "Kids' Puzzles": {}},
                     "Games": {"Board Games": {}, "Card Games": {}}},
    "Food, Beverages & Tobacco": {"Beverages": {"Coffee": {"Ground Coffee": {}, "Coffee Beans": {}}, "Tea": {}},
                                  "Food Items": {"Snack Foods": {"Chips": {}}, "Candy & Chocolate": {}}},
    "Electronics": {"Audio": {"Headphones": {}, "Speakers": {}},
                    "Computers": {"Laptops": {}, "Computer Accessories": {"Keyboards": {}, "Mice": {}}}},
}
BRANDS = ("giorgio armani", "Nike", "Le Creuset", "Patagonia", "Muji", "Ōura", "Søstrene Grene", "L'Oréal",
          "Acme Goods", "北欧生活", "Blue Bottle", "Fjällräven", "LEGO", "Sony", "Casio", "Handmade by Ana")
NOUNS = ("shirt", "mug", "tent", "serum", "necklace", "sneakers", "candle", "headphones", "coffee", "puzzle",
         "backpack", "pan", "poster", "keyboard", "yoga mat", "vase")
ADJECTIVES = ("classic", "organic", "vintage", "limited edition", "ultra-light", "handcrafted", "premium",
              "eco-friendly", "oversized", "compact", "waterproof", "hand-painted")
SENTENCES = (
    "Made from responsibly sourced materials and finished by hand.",
    "Machine washable at 30°C; do not tumble dry.",
    "Ships within 2–3 business days — free returns for 30 days.",
    "Perfect as a gift: arrives in a recyclable box.",
    "Dimensions: 24 × 18 × 6 cm, weight 340 g.",
    "Pre-owned, gently used, no visible defects.",
    "Compatible with most standard accessories.",
    "Limited stock available. 限量供应 🎁",
)
HTML_WRAPPERS = (
    "<p>{}</p>",
    "<div class=\"product-desc\"><ul><li>{}</li></ul></div>",
    "<style>.desc{{font-family:Arial;color:#333;margin:0 auto}} .hl{{font-weight:bold}}</style>"
    "<div class=\"desc\"><span class=\"hl\">{}</span></div>",
    "<script>window.dataLayer=window.dataLayer||[];function gtag(){{dataLayer.push(arguments);}}"
    "gtag('js',new Date());</script><p>{}</p>",
    "<table><tr><td>Details</td><td>{}</td></tr></table><!-- imported from legacy store -->",
)
CSS_FILLER = (".product-grid .item:nth-child(2n+1){margin-right:1.5rem;display:flex;align-items:center}"
              "@media (max-width:768px){.product-grid .item{width:100%!important}}")

# The most common image sizes of the real catalogue (approximate counts), all JPEG, read off the plots in
# https://github.com/mlcommons/inference/blob/master/multimodal/qwen3-vl/notebooks/shopify-global-catalogue.ipynb
REAL_SIZES: tuple[tuple[int, int], ...] = (
    (1000, 4200), (800, 3300), (500, 1900), (1200, 1900), (1500, 1850), (512, 1800), (600, 1700), (1024, 1500),
    (2000, 1300), (1600, 1000), (1080, 900), (750, 800), (2048, 800), (400, 700), (700, 600), (900, 600),
    (1280, 500), (1400, 400), (1800, 400), (2500, 300), (3000, 200), (4000, 100),
)
SMALL_SIZES = ((8, 8), (16, 16), (32, 48), (64, 64), (100, 75), (128, 128), (75, 200), (256, 256), (300, 240))
BIG_SIZES = ((1600, 1200), (2048, 2048), (1200, 1800))
FORMAT_MODES: tuple[tuple[str, str], ...] = (
    ("JPEG", "RGB"), ("JPEG", "L"), ("JPEG", "CMYK"), ("PNG", "RGB"), ("PNG", "RGBA"), ("PNG", "P"),
    ("PNG", "L"), ("WEBP", "RGB"), ("WEBP", "RGBA"),
)


@dataclass(frozen=True)
class SyntheticSpec:
    """What to write; `profile` picks image sizes/formats and description lengths."""

    n_samples: int
    seed: int = 0
    dataset: DatasetKind = "product-catalogue"
    profile: Profile = "small"
    row_group_size: int = ROW_GROUP_SIZE


def _category_paths() -> list[str]:
    paths: list[str] = []

    def walk(prefix: list[str], node: dict) -> None:
        for name, children in node.items():
            path = [*prefix, name]
            paths.append(" > ".join(path))
            walk(path, children)

    walk([], TAXONOMY)
    return paths


CATEGORY_PATHS = [p for p in _category_paths() if " > " in p]  # candidates are at least two levels deep


def _image(rng: np.random.Generator, size: tuple[int, int], mode: str) -> Image.Image:
    """A gradient with a few shapes and a little noise: compresses like a product photo, not like static."""
    w, h = size
    x = np.linspace(0, 1, w, dtype=np.float32)[None, :, None]
    y = np.linspace(0, 1, h, dtype=np.float32)[:, None, None]
    c0, c1, c2 = (rng.uniform(0, 255, 3).astype(np.float32) for _ in range(3))
    pixels = c0 + (c1 - c0) * x + (c2 - c0) * y
    if w * h <= 1 << 20:
        pixels = pixels + rng.normal(0, 6, (h, w, 1)).astype(np.float32)
    img = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(1, 5))):
        x0, x1 = sorted(int(v) for v in rng.integers(0, w, 2))
        y0, y1 = sorted(int(v) for v in rng.integers(0, h, 2))
        fill = tuple(int(v) for v in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)([x0, y0, x1, y1], fill=fill)
    if mode == "RGBA":
        img.putalpha(Image.linear_gradient("L").resize(size))
    elif mode == "P":
        img = img.quantize(colors=64)
    elif mode != "RGB":
        img = img.convert(mode)
    return img


def _encode(img: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    options = {"JPEG": {"quality": 90}, "WEBP": {"quality": 80, "method": 0}, "PNG": {"compress_level": 1}}
    img.save(buf, format=fmt, **options[fmt])
    return buf.getvalue()


def _description(rnd: random.Random, target_chars: int) -> str:
    parts: list[str] = []
    length = 0
    while length < target_chars:
        sentence = rnd.choice(SENTENCES)
        piece = rnd.choice(HTML_WRAPPERS).format(sentence) if rnd.random() < 0.5 else sentence
        if target_chars > 2000 and rnd.random() < 0.3:
            piece = f"<style>{CSS_FILLER * rnd.randint(1, 8)}</style>{piece}"
        parts.append(piece)
        length += len(piece) + 1
    return " ".join(parts)


def _image_plan(rnd: random.Random, profile: str) -> tuple[tuple[int, int], str, str]:
    """(size, format, mode) for one sample."""
    if profile == "realistic":
        side = rnd.choices([s for s, _ in REAL_SIZES], weights=[c for _, c in REAL_SIZES])[0]
        shape = rnd.random()
        size = (side, side * 3 // 4) if shape < 0.05 else (side * 3 // 4, side) if shape < 0.10 else (side, side)
        return size, "JPEG", "RGB"
    fmt, mode = rnd.choice(FORMAT_MODES)
    if profile == "mixed" and rnd.random() < 0.1:
        return rnd.choice(BIG_SIZES), fmt, mode
    return rnd.choice(SMALL_SIZES), fmt, mode


def _description_chars(rnd: random.Random, profile: str) -> int:
    if profile == "realistic":
        # Text tokens per sample mostly 550-1,000 (about 450 of them are the prompt's fixed text),
        # a long tail to ~20,000: a log-normal of description tokens, ~4 characters per token.
        tokens = min(19000, int(math.exp(rnd.gauss(math.log(220), 0.8))))
        return 4 * tokens
    return rnd.randint(20, 600)


def synthetic_sample(seed: int, index: int, profile: str = "small") -> dict:
    """The row for sample `index`: depends only on (seed, index, profile), not on how many are written."""
    rnd = random.Random(f"{seed}:{index}:{profile}")
    rng = np.random.default_rng([seed, index])
    size, fmt, mode = _image_plan(rnd, profile)
    candidates = rnd.sample(CATEGORY_PATHS, rnd.choice((8, 9, 9)))
    brand = rnd.choice(BRANDS)
    title = f"{brand} {rnd.choice(ADJECTIVES)} {rnd.choice(NOUNS)}"
    if rnd.random() < 0.1:
        title += rnd.choice((" ✨", " (2-pack)", " – 北欧风格"))
    return {
        "product_title": title,
        "product_description": _description(rnd, _description_chars(rnd, profile)),
        "product_image": {"bytes": _encode(_image(rng, size, mode), fmt), "path": None},
        "potential_product_categories": candidates,
        "ground_truth_brand": brand,
        "ground_truth_is_secondhand": rnd.random() < 0.2,
        "ground_truth_category": rnd.choice(candidates),
    }


def _idle_cpus() -> int:
    """The CPUs this process may use less the machine's load (its 1-minute average), at least 1, at most MAX_WORKERS:
    on a busy machine (CI's two test workers on two cores) more processes would only take time from the others."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(MAX_WORKERS, round(cpus - os.getloadavg()[0])))


def _samples(seed: int, indices: range, profile: str, workers: int) -> list[dict]:
    """synthetic_sample for each index, in order; in `workers` child interpreters when more than one, each drawing
    every workers-th index (plain `python -c` processes: nothing of the caller's main module or threads is needed
    there, as multiprocessing's spawn and fork would need)."""
    if workers <= 1 or len(indices) < 2:
        return [synthetic_sample(seed, i, profile) for i in indices]
    workers = min(workers, len(indices))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryDirectory(prefix="q3vl-catalogue-") as tmp:
        parts = [Path(tmp) / f"part-{k}" for k in range(workers)]
        procs = []
        for k, part in enumerate(parts):
            with open(part.with_suffix(".err"), "wb") as err:
                procs.append(subprocess.Popen([sys.executable, "-c", _DRAW_PART, str(seed), profile,
                                               str(indices.start + k), str(indices.stop), str(workers), str(part)],
                                              env=env, stderr=err))
        try:
            codes = [proc.wait() for proc in procs]
        except BaseException:  # an interrupt: no worker outlives the call
            for proc in procs:
                proc.kill()
                proc.wait()
            raise
        for k, code in enumerate(codes):
            if code != 0:
                err = parts[k].with_suffix(".err").read_text(errors="replace").strip()[-2000:]
                raise RuntimeError(f"drawing synthetic samples: worker {k} of {workers} exited with code {code}: {err}")
        drawn = [pickle.loads(part.read_bytes()) for part in parts]
    return [drawn[k % workers][k // workers] for k in range(len(indices))]


_ROOT = Path(__file__).resolve().parent.parent  # the repository: the workers import this module from there
_DRAW_PART = """import pickle, sys
from pathlib import Path
from harness.synthetic_catalogue import synthetic_sample
seed, profile, first, stop, step, out = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6]), sys.argv[6]
Path(out).write_bytes(pickle.dumps([synthetic_sample(int(seed), i, profile) for i in range(first, stop, step)]))
"""


def _bomb_png(side: int = BOMB_SIDE) -> bytes:
    """A valid 1-bit grayscale PNG of side x side pixels, all black: a decompression bomb built cheaply
    (each row is a filter byte and side/8 zero bytes, deflated as a stream)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    row = bytes(1 + (side + 7) // 8)
    deflate = zlib.compressobj(9)
    body = b"".join(deflate.compress(row * 1000) for _ in range(side // 1000))
    body += deflate.compress(row * (side % 1000)) + deflate.flush()
    header = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", body) + chunk(b"IEND", b"")


def _plant_bad_sample(row: dict, kind: str, rng: np.random.Generator) -> dict:
    """`row` with the fault `kind`: a broken or hostile image, an over-long prompt or invalid UTF-8 text.
    cmyk and 16bit are unusual but valid images (they must be served, not failed)."""
    row = dict(row)
    if kind == "undecodable":
        row["product_image"] = {"bytes": b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4, "path": None}
    elif kind == "empty_image":
        row["product_image"] = {"bytes": b"", "path": None}
    elif kind == "bomb":
        row["product_image"] = {"bytes": _bomb_png(), "path": None}
    elif kind == "cmyk":
        row["product_image"] = {"bytes": _encode(_image(rng, (96, 64), "CMYK"), "JPEG"), "path": None}
    elif kind == "16bit":
        gray = np.asarray(_image(rng, (64, 96), "L"), dtype=np.uint16) * 257
        row["product_image"] = {"bytes": _encode(Image.fromarray(gray), "PNG"), "path": None}
    elif kind == "long_prompt":
        row["product_description"] = (" ".join(SENTENCES) + " ") * (LONG_PROMPT_CHARS // len(" ".join(SENTENCES)))
    elif kind == "bad_utf8":
        row["product_title"] = f"{row['product_title']} {BAD_UTF8_MARK}"
    else:
        raise ValueError(f"unknown bad sample kind {kind!r}; expected one of {BAD_SAMPLES}")
    return row


def _with_invalid_utf8(table: pa.Table) -> pa.Table:
    """Parquet string columns should hold UTF-8 but nothing enforces it: a foreign writer can store any
    bytes. BAD_UTF8_MARK in product_title becomes the bytes 0xff 0xfe (a bare string view, not validated)."""
    column = table.column("product_title").combine_chunks()
    raw = [None if v is None else v.encode().replace(BAD_UTF8_MARK.encode(), b"\xff\xfe") for v in column.to_pylist()]
    bad = pa.array(raw, pa.binary()).view(pa.string())
    return table.set_column(table.schema.get_field_index("product_title"), "product_title", bad)


ARROW_SCHEMA = pa.schema(
    [
        pa.field("product_title", pa.string()),
        pa.field("product_description", pa.string()),
        pa.field("product_image", pa.struct([pa.field("bytes", pa.binary()), pa.field("path", pa.string())])),
        pa.field("potential_product_categories", pa.list_(pa.string())),
        pa.field("ground_truth_brand", pa.string()),
        pa.field("ground_truth_is_secondhand", pa.bool_()),
        pa.field("ground_truth_category", pa.string()),
    ],
    # What `datasets` writes, so load_dataset() also reads product_image as an Image feature.
    metadata={"huggingface": json.dumps({"info": {"features": {
        "product_title": {"dtype": "string", "_type": "Value"},
        "product_description": {"dtype": "string", "_type": "Value"},
        "product_image": {"_type": "Image"},
        "potential_product_categories": {"feature": {"dtype": "string", "_type": "Value"}, "_type": "Sequence"},
        "ground_truth_brand": {"dtype": "string", "_type": "Value"},
        "ground_truth_is_secondhand": {"dtype": "bool", "_type": "Value"},
        "ground_truth_category": {"dtype": "string", "_type": "Value"},
    }}})},
)
assert tuple(ARROW_SCHEMA.names) == COLUMNS


def _split_sizes(n: int, splits: Sequence[str]) -> list[int]:
    if len(splits) == 1:
        return [n]
    n_test = max(1, round(n * (1 - TRAIN_FRACTION))) if n > 1 else 0
    return [n - n_test, n_test]


def _write_shard(path: Path, rows: list[dict], row_group_size: int) -> None:
    table = pa.Table.from_pylist(rows, schema=ARROW_SCHEMA)
    if any(BAD_UTF8_MARK in (row["product_title"] or "") for row in rows):
        table = _with_invalid_utf8(table)
    tmp = path.with_suffix(".parquet.tmp")
    pq.write_table(table, tmp, row_group_size=row_group_size)
    tmp.replace(path)


def write_synthetic_catalogue(
    out_dir: str | Path,
    n_samples: int,
    seed: int = 0,
    dataset: DatasetKind = "product-catalogue",
    profile: Profile = "small",
    row_group_size: int = ROW_GROUP_SIZE,
    bad_samples: Mapping[int, BadSample] | None = None,
    workers: int | None = None,
) -> Path:
    """Writes data/<split>-NNNNN-of-MMMMM.parquet (train 2 shards when it can, test 1) and returns out_dir.

    `bad_samples` maps sample indices to a fault from BAD_SAMPLES planted in that row (fault tests). `workers`:
    processes drawing the samples (the same rows however many); None: one per idle CPU, up to MAX_WORKERS, from
    PARALLEL_FROM_SAMPLES samples on.
    """
    if n_samples < 1:
        raise ValueError(f"n_samples must be >= 1, got {n_samples}")
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; expected one of {PROFILES}")
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; expected one of {sorted(DATASETS)}")
    bad_samples = dict(bad_samples or {})
    for index, kind in bad_samples.items():
        if not 0 <= index < n_samples or kind not in BAD_SAMPLES:
            raise ValueError(f"bad_samples[{index}] = {kind!r}: need an index below {n_samples} and one of {BAD_SAMPLES}")
    root = Path(out_dir)
    data_dir = root / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    for stale in data_dir.glob("*.parquet"):
        stale.unlink()
    splits = DATASETS[dataset].splits
    if workers is None:
        workers = _idle_cpus() if n_samples >= PARALLEL_FROM_SAMPLES else 1
    if workers > 1:
        logger.info("drawing %d synthetic samples in %d processes", n_samples, workers)
    index = 0
    for split, size in zip(splits, _split_sizes(n_samples, splits)):
        rows = _samples(seed, range(index, index + size), profile, workers)
        for i, kind in bad_samples.items():
            if index <= i < index + size:
                rows[i - index] = _plant_bad_sample(rows[i - index], kind, np.random.default_rng([seed, i]))
        index += size
        n_shards = 2 if split == "train" and size >= 2 else 1
        bounds = [round(k * size / n_shards) for k in range(n_shards + 1)]
        for k in range(n_shards):
            name = f"{split}-{k:05d}-of-{n_shards:05d}.parquet"
            _write_shard(data_dir / name, rows[bounds[k]:bounds[k + 1]], row_group_size)
    logger.info("wrote %d synthetic %s samples (%s profile, seed %d) to %s", n_samples, dataset, profile, seed, root)
    return root


CLI_DESCRIPTION = """Writes a synthetic Shopify product catalogue in the hub's parquet layout (deterministic by seed).

Example: python scripts/make_synthetic_catalogue.py --out .cache/catalogue --samples 64 --seed 0
"""


def main(argv: Sequence[str] | None = None) -> int:
    """The command line of scripts/make_synthetic_catalogue.py: parses `argv`, writes the catalogue, returns 0."""
    import argparse

    parser = argparse.ArgumentParser(description=CLI_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path, help="catalogue directory (data/*.parquet go here)")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dataset", default="product-catalogue", choices=sorted(DATASETS),
                        help="product-catalogue: train+test shards; catalogue-8k: train only")
    parser.add_argument("--profile", default="small", choices=PROFILES,
                        help="small: tiny images of every format (fast); mixed: adds multi-megapixel images; "
                             "realistic: all JPEG, sizes and text lengths of the real dataset (GPU perf work)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    write_synthetic_catalogue(args.out, args.samples, args.seed, args.dataset, args.profile)
    return 0
