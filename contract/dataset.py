"""The Shopify product catalogue as stored by the Hugging Face hub (parquet shards under data/), read lazily.

Random access by sample index; image bytes are read one parquet row group at a time, never all at once.
"""

from __future__ import annotations

import bisect
import logging
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, overload

import pyarrow as pa
import pyarrow.parquet as pq

logger = logging.getLogger(__name__)

DatasetKind = Literal["product-catalogue", "catalogue-8k"]


@dataclass(frozen=True)
class DatasetSpec:
    """Where a catalogue comes from and what it must look like."""

    repo_id: str
    revision: str
    splits: tuple[str, ...]  # concatenated in this order
    size: int


DATASETS: dict[str, DatasetSpec] = {
    "product-catalogue": DatasetSpec(
        "Shopify/product-catalogue", "d5c517c509f5aca99053897ef1de797d6d7e5aa5", ("train", "test"), 48289),
    "catalogue-8k": DatasetSpec(
        "nvidia/Shopify-product-catalogue-8k", "2bc8c6c4b6ebd27b880b0cba519cb45d09867045", ("train",), 8000),
}

TEXT_COLUMNS = ("product_title", "product_description", "potential_product_categories",
                "ground_truth_brand", "ground_truth_is_secondhand", "ground_truth_category")
IMAGE_COLUMN = "product_image"
COLUMNS = (*TEXT_COLUMNS[:2], IMAGE_COLUMN, *TEXT_COLUMNS[2:])
GROUND_TRUTH_COLUMNS = ("potential_product_categories", "ground_truth_brand",
                        "ground_truth_is_secondhand", "ground_truth_category")
_SHARD_NAME = re.compile(r"^(?P<split>[\w.]+)-(?P<i>\d+)-of-(?P<n>\d+)\.parquet$")


class DatasetNotFoundError(FileNotFoundError):
    """The catalogue is not on disk where it was looked for."""


class DatasetFormatError(ValueError):
    """The files are there but do not have the catalogue's layout or columns."""


@dataclass(frozen=True)
class CatalogueSample:
    """One product. description may be None where the dataset holds a null (the prompt then reads 'None')."""

    index: int
    title: str
    description: str | None
    image_bytes: bytes
    image_format: str  # PIL format name from the bytes' signature: JPEG, PNG, WEBP, GIF, BMP, TIFF or UNKNOWN
    # image_bytes is empty when the row holds no embedded image (its prompt then fails with a clear error)
    categories: list[str]
    gt_brand: str
    gt_is_secondhand: bool
    gt_category: str


@dataclass(frozen=True)
class GroundTruth:
    """What accuracy scoring needs of a sample (no image)."""

    category: str
    brand: str
    is_secondhand: bool
    categories: list[str]


def download_hint(kind: str, path: Path) -> str:
    spec = DATASETS[kind]
    return (f"Get it on a machine with internet:\n  huggingface-cli download {spec.repo_id} --repo-type dataset "
            f"--revision {spec.revision} --local-dir DIR\ncopy DIR to this machine and pass its path (it holds "
            f"data/{spec.splits[0]}-00000-of-NNNNN.parquet ...). "
            f"A synthetic stand-in: scripts/make_synthetic_catalogue.py --out DIR")


def detect_image_format(data: bytes) -> str:
    """The image container from its first bytes, as PIL names it."""
    if data[:3] == b"\xff\xd8\xff":
        return "JPEG"
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "PNG"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "GIF"
    if data[:2] == b"BM":
        return "BMP"
    if data[:4] in (b"II*\x00", b"MM\x00*"):
        return "TIFF"
    return "UNKNOWN"


@dataclass(frozen=True)
class _RowGroup:
    file: pq.ParquetFile
    path: Path
    group: int
    start: int  # global index of its first row


class Catalogue(Sequence[CatalogueSample]):
    """The samples of one catalogue in the reference's order (splits concatenated)."""

    def __init__(self, root: Path, kind: str, shards: Sequence[Path]):
        self.root = root
        self.kind = kind
        self._groups: list[_RowGroup] = []
        start = 0
        for path in shards:
            file = pq.ParquetFile(path)
            _check_schema(file.schema_arrow, path)
            for g in range(file.metadata.num_row_groups):
                self._groups.append(_RowGroup(file, path, g, start))
                start += file.metadata.row_group(g).num_rows
        self._starts = [g.start for g in self._groups]
        self._size = start
        self._cached: tuple[int, list[dict[str, Any]]] | None = None
        self._ground_truth: list[GroundTruth] | None = None

    def __len__(self) -> int:
        return self._size

    @overload
    def __getitem__(self, index: int) -> CatalogueSample: ...
    @overload
    def __getitem__(self, index: slice) -> list[CatalogueSample]: ...

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.samples(range(*index.indices(self._size)))
        return self.samples([index])[0]

    def __iter__(self) -> Iterator[CatalogueSample]:
        for g in range(len(self._groups)):
            yield from self._rows_of_group(g)

    def samples(self, indices: Iterable[int]) -> list[CatalogueSample]:
        """The samples at `indices`, in that order; each row group involved is read once."""
        wanted = [self._check_index(i) for i in indices]
        by_group: dict[int, list[int]] = {}
        for i in wanted:
            by_group.setdefault(self._group_of(i), []).append(i)
        found: dict[int, CatalogueSample] = {}
        for g in sorted(by_group):
            rows = self._read_group(g)
            start = self._groups[g].start
            for i in by_group[g]:
                found[i] = self._sample(i, rows[i - start])
        return [found[i] for i in wanted]

    def ground_truth(self) -> list[GroundTruth]:
        """Ground truth of every sample, read without the image column (cached)."""
        if self._ground_truth is None:
            out: list[GroundTruth] = []
            files = dict.fromkeys((g.file, g.path) for g in self._groups)
            for file, _ in files:
                rows = _to_pylist(file.read(columns=list(GROUND_TRUTH_COLUMNS)), len(out))
                out.extend(
                    GroundTruth(category=r["ground_truth_category"], brand=r["ground_truth_brand"],
                                is_secondhand=bool(r["ground_truth_is_secondhand"]),
                                categories=list(r["potential_product_categories"] or []))
                    for r in rows)
            self._ground_truth = out
        return self._ground_truth

    def _check_index(self, index: int) -> int:
        i = int(index)
        if i < 0:
            i += self._size
        if not 0 <= i < self._size:
            raise IndexError(f"sample index {index} out of range for a catalogue of {self._size}")
        return i

    def _group_of(self, index: int) -> int:
        return bisect.bisect_right(self._starts, index) - 1

    def _read_group(self, g: int) -> list[dict[str, Any]]:
        if self._cached is None or self._cached[0] != g:
            group = self._groups[g]
            table = group.file.read_row_group(group.group, columns=list(COLUMNS))
            self._cached = (g, _to_pylist(table, group.start))
        return self._cached[1]

    def _rows_of_group(self, g: int) -> Iterator[CatalogueSample]:
        start = self._groups[g].start
        for k, row in enumerate(self._read_group(g)):
            yield self._sample(start + k, row)

    def _sample(self, index: int, row: dict[str, Any]) -> CatalogueSample:
        image = row[IMAGE_COLUMN] or {}
        data = image.get("bytes")
        if data is None:
            # Served as an error response later (its prompt cannot be built), not a failed load.
            path = self._groups[self._group_of(index)].path
            logger.warning("sample %d (%s): product_image has no embedded bytes (path=%r)",
                           index, path, image.get("path"))
            data = b""
        return CatalogueSample(
            index=index,
            title=row["product_title"],
            description=row["product_description"],
            image_bytes=data,
            image_format=detect_image_format(data),
            categories=list(row["potential_product_categories"] or []),
            gt_brand=row["ground_truth_brand"],
            gt_is_secondhand=bool(row["ground_truth_is_secondhand"]),
            gt_category=row["ground_truth_category"],
        )


def _to_pylist(table: pa.Table, first_index: int) -> list[dict[str, Any]]:
    """Rows as dicts. Parquet does not enforce UTF-8 in string columns; text that is not valid UTF-8 is
    decoded with U+FFFD for the bad bytes (a warning names the sample and column) instead of failing the
    whole row group, so the sample is still served."""
    try:
        return table.to_pylist()
    except UnicodeDecodeError:
        pass
    as_bytes = {pa.string(): pa.binary(), pa.large_string(): pa.large_binary()}
    fields = [pa.field(f.name, as_bytes.get(f.type, f.type)) if not pa.types.is_list(f.type)
              else pa.field(f.name, pa.list_(as_bytes.get(f.type.value_type, f.type.value_type)))
              for f in table.schema]
    text = {f.name for f, b in zip(table.schema, fields) if f.type != b.type}
    rows = table.cast(pa.schema(fields)).to_pylist()
    for k, row in enumerate(rows):
        for name in text:
            row[name] = _decode_lenient(row[name], first_index + k, name)
    return rows


def _decode_lenient(value: Any, index: int, column: str) -> Any:
    if isinstance(value, list):
        return [_decode_lenient(v, index, column) for v in value]
    if not isinstance(value, bytes):
        return value
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as exc:
        logger.warning("sample %d: %s is not valid UTF-8 (%s); bad bytes replaced by U+FFFD", index, column, exc.reason)
        return value.decode("utf-8", errors="replace")


def _check_schema(schema: pa.Schema, path: Path) -> None:
    names = set(schema.names)
    for column in COLUMNS:
        if column not in names:
            raise DatasetFormatError(f"{path}: column {column!r} is missing (has {sorted(names)})")
    image_type = schema.field(IMAGE_COLUMN).type
    if not (pa.types.is_struct(image_type) and image_type.get_field_index("bytes") >= 0):
        raise DatasetFormatError(f"{path}: column 'product_image' must be the HF Image struct "
                                 f"{{bytes, path}}, got {image_type}")


def find_shards(root: Path, kind: str) -> list[Path]:
    """data/<split>-NNNNN-of-MMMMM.parquet for each split in order; every shard of a split must be there."""
    spec = DATASETS[kind]
    data_dir = root / "data"
    shards: list[Path] = []
    for split in spec.splits:
        found = sorted(data_dir.glob(f"{split}-*.parquet"))
        if not found:
            raise DatasetNotFoundError(f"{kind}: no {split} shards in {data_dir}.\n{download_hint(kind, root)}")
        totals = set()
        numbers = set()
        for path in found:
            m = _SHARD_NAME.match(path.name)
            if m is None or m["split"] != split:
                raise DatasetFormatError(f"{path}: shard name is not {split}-NNNNN-of-MMMMM.parquet")
            totals.add(int(m["n"]))
            numbers.add(int(m["i"]))
        if len(totals) != 1 or numbers != set(range(totals.pop())):
            raise DatasetFormatError(f"{data_dir}: the {split} shards are incomplete or mixed: "
                                     f"{[p.name for p in found]}.\n{download_hint(kind, root)}")
        shards.extend(found)
    return shards


def catalogue_size(path: str | Path, dataset: DatasetKind = "product-catalogue") -> int:
    """Rows of the catalogue at `path`, from its shards' parquet footers alone (no row is read);
    DatasetNotFoundError / DatasetFormatError as load_catalogue raises them."""
    root = Path(path)
    if not root.is_dir():
        raise DatasetNotFoundError(f"{dataset}: {root} is not a directory.\n{download_hint(dataset, root)}")
    rows = 0
    for shard in find_shards(root, dataset):
        try:
            rows += pq.read_metadata(shard).num_rows
        except pa.ArrowException as exc:
            raise DatasetFormatError(f"{shard}: not a readable parquet file ({exc})") from None
    return rows


def load_catalogue(path: str | Path, dataset: DatasetKind = "product-catalogue") -> Catalogue:
    """Opens a downloaded (or synthetic) catalogue; reads only parquet footers until samples are asked for."""
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; expected one of {sorted(DATASETS)}")
    root = Path(path)
    if not root.is_dir():
        raise DatasetNotFoundError(f"{dataset}: {root} is not a directory.\n{download_hint(dataset, root)}")
    catalogue = Catalogue(root, dataset, find_shards(root, dataset))
    expected = DATASETS[dataset].size
    if len(catalogue) != expected:
        logger.info("%s at %s has %d samples (the benchmark's has %d)", dataset, root, len(catalogue), expected)
    return catalogue
