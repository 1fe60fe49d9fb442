"""Catalogue loading (hub parquet layout), the synthetic catalogue writer, and the QSL's sample store."""

from __future__ import annotations

import io
import shutil
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from contract.dataset import (
    DatasetFormatError,
    DatasetNotFoundError,
    detect_image_format,
    load_catalogue,
)
from contract.prompt import PromptBuilder
from contract.tokenizer import load_tokenizer
from harness import synthetic_catalogue as syn
from harness.sample_store import SampleStore


@pytest.fixture(scope="module")
def catalogue_dir(tmp_path_factory) -> Path:
    return syn.write_synthetic_catalogue(tmp_path_factory.mktemp("cat") / "pc", 64, seed=3)


@pytest.fixture(scope="module")
def catalogue(catalogue_dir):
    return load_catalogue(catalogue_dir, "product-catalogue")


def test_writer_uses_the_hub_shard_layout(catalogue_dir, tmp_path):
    names = sorted(p.name for p in (catalogue_dir / "data").iterdir())
    assert names == ["test-00000-of-00001.parquet", "train-00000-of-00002.parquet", "train-00001-of-00002.parquet"]
    eightk = syn.write_synthetic_catalogue(tmp_path / "8k", 5, seed=0, dataset="catalogue-8k")
    assert sorted(p.name for p in (eightk / "data").iterdir()) == ["train-00000-of-00002.parquet",
                                                                   "train-00001-of-00002.parquet"]
    assert len(load_catalogue(eightk, "catalogue-8k")) == 5


def test_image_column_is_the_hf_image_struct(catalogue_dir):
    schema = pq.read_schema(catalogue_dir / "data" / "test-00000-of-00001.parquet")
    assert schema.field("product_image").type == pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    assert schema.field("potential_product_categories").type == pa.list_(pa.string())
    assert b'"_type": "Image"' in schema.metadata[b"huggingface"]


def test_catalogue_concatenates_train_then_test_in_order(catalogue, catalogue_dir):
    assert len(catalogue) == 64
    train = pq.read_table(catalogue_dir / "data" / "train-00000-of-00002.parquet").to_pylist()
    test = pq.read_table(catalogue_dir / "data" / "test-00000-of-00001.parquet").to_pylist()
    assert catalogue[0].title == train[0]["product_title"]
    assert catalogue[len(catalogue) - len(test)].title == test[0]["product_title"]
    assert catalogue[-1].image_bytes == test[-1]["product_image"]["bytes"]


def test_samples_are_random_access_in_the_requested_order(catalogue):
    picked = catalogue.samples([40, 3, 63, 3, 17])
    assert [s.index for s in picked] == [40, 3, 63, 3, 17]
    assert [s.title for s in picked] == [catalogue[i].title for i in (40, 3, 63, 3, 17)]
    assert [s.index for s in catalogue[10:13]] == [10, 11, 12]
    with pytest.raises(IndexError, match="64"):
        catalogue[64]


def test_sample_fields_follow_the_dataset(catalogue):
    for s in catalogue:
        assert 8 <= len(s.categories) <= 9
        assert s.gt_category in s.categories
        assert all(" > " in c for c in s.categories)
        assert isinstance(s.gt_is_secondhand, bool) and s.gt_brand
        assert s.image_format == Image.open(io.BytesIO(s.image_bytes)).format
    assert any("<style>" in s.description or "<p>" in s.description for s in catalogue)


def test_ground_truth_reads_without_images_and_matches_samples(catalogue):
    truth = catalogue.ground_truth()
    assert len(truth) == len(catalogue)
    for s, t in zip(catalogue, truth):
        assert (t.category, t.brand, t.is_secondhand, t.categories) == (
            s.gt_category, s.gt_brand, s.gt_is_secondhand, s.categories)


def test_synthetic_images_cover_formats_modes_and_sizes(catalogue):
    formats, modes, sizes = Counter(), Counter(), set()
    for s in catalogue:
        with Image.open(io.BytesIO(s.image_bytes)) as img:
            formats[img.format] += 1
            modes[img.mode] += 1
            sizes.add(img.size)
    assert set(formats) == {"JPEG", "PNG", "WEBP"}
    assert {"RGB", "RGBA", "P", "L", "CMYK"} <= set(modes)
    assert min(w * h for w, h in sizes) <= 16 * 16 and max(w * h for w, h in sizes) <= 300 * 300


def test_writer_is_deterministic_by_seed(catalogue, tmp_path):
    again = load_catalogue(syn.write_synthetic_catalogue(tmp_path / "a", 64, seed=3))
    other = load_catalogue(syn.write_synthetic_catalogue(tmp_path / "b", 64, seed=4))
    assert [s.image_bytes for s in again] == [s.image_bytes for s in catalogue]
    assert [s.description for s in again] == [s.description for s in catalogue]
    assert [s.title for s in other] != [s.title for s in catalogue]


def test_samples_drawn_in_worker_processes_are_the_ones_drawn_in_one(catalogue_dir, tmp_path):
    parallel = syn.write_synthetic_catalogue(tmp_path / "p", 64, seed=3, workers=2)
    names = sorted(p.name for p in (catalogue_dir / "data").iterdir())
    assert sorted(p.name for p in (parallel / "data").iterdir()) == names
    for name in names:
        assert pq.read_table(parallel / "data" / name).equals(pq.read_table(catalogue_dir / "data" / name)), name


def test_a_worker_process_that_fails_is_named_with_its_error(tmp_path, monkeypatch):
    monkeypatch.setattr(syn, "_DRAW_PART", "import sys; sys.exit('no room on the disk')")
    with pytest.raises(RuntimeError, match=r"worker 0 of 2 exited with code 1: no room on the disk"):
        syn.write_synthetic_catalogue(tmp_path / "p", 8, seed=3, workers=2)


def test_realistic_profile_is_all_jpeg_at_real_dataset_sizes():
    real_sides = {side for side, _ in syn.REAL_SIZES}
    for index in range(6):
        row = syn.synthetic_sample(seed=0, index=index, profile="realistic")
        with Image.open(io.BytesIO(row["product_image"]["bytes"])) as img:
            assert img.format == "JPEG"
            assert max(img.size) in real_sides


def test_cli_writes_a_catalogue(tmp_path):
    from harness.synthetic_catalogue import main

    assert main(["--out", str(tmp_path / "c"), "--samples", "3", "--seed", "1", "--dataset", "catalogue-8k"]) == 0
    assert len(load_catalogue(tmp_path / "c", "catalogue-8k")) == 3


def test_missing_dataset_says_how_to_download_it(tmp_path):
    with pytest.raises(DatasetNotFoundError, match="huggingface-cli download Shopify/product-catalogue "
                                                   "--repo-type dataset --revision d5c517c5"):
        load_catalogue(tmp_path / "nowhere")
    (tmp_path / "empty" / "data").mkdir(parents=True)
    with pytest.raises(DatasetNotFoundError, match="nvidia/Shopify-product-catalogue-8k"):
        load_catalogue(tmp_path / "empty", "catalogue-8k")


def test_missing_split_or_shard_is_an_error(catalogue_dir, tmp_path):
    no_shard = Path(shutil.copytree(catalogue_dir, tmp_path / "a"))
    (no_shard / "data" / "train-00001-of-00002.parquet").unlink()
    with pytest.raises(DatasetFormatError, match="incomplete"):
        load_catalogue(no_shard)
    no_test = Path(shutil.copytree(catalogue_dir, tmp_path / "b"))
    (no_test / "data" / "test-00000-of-00001.parquet").unlink()
    with pytest.raises(DatasetNotFoundError, match="no test shards"):
        load_catalogue(no_test, "product-catalogue")


def test_missing_column_names_the_column_and_file(catalogue_dir, tmp_path):
    copy = Path(shutil.copytree(catalogue_dir, tmp_path / "c"))
    shard = copy / "data" / "test-00000-of-00001.parquet"
    pq.write_table(pq.read_table(shard).drop_columns(["ground_truth_brand"]), shard)
    with pytest.raises(DatasetFormatError, match=r"test-00000-of-00001\.parquet: column 'ground_truth_brand'"):
        load_catalogue(copy)


def test_image_format_is_detected_from_bytes():
    def encoded(fmt, mode="RGB"):
        buf = io.BytesIO()
        Image.new(mode, (4, 4)).save(buf, format=fmt)
        return buf.getvalue()

    for fmt in ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF"):
        assert detect_image_format(encoded(fmt)) == fmt
    assert detect_image_format(b"garbage") == "UNKNOWN"


# ---- harness/sample_store.py ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def builder():
    return PromptBuilder(load_tokenizer(), "v6.0")


def test_store_keeps_original_bytes_and_ready_prompts(catalogue, builder):
    store = SampleStore(catalogue, builder)
    store.load([5, 9, 40])
    assert store.memory_bytes > sum(len(catalogue[i].image_bytes) for i in (5, 9, 40))
    for i in (5, 9, 40):
        prepared = store.get(i)
        assert prepared.error is None
        assert prepared.prompt.images == [catalogue[i].image_bytes]
        assert prepared.prompt == builder(catalogue[i])
    held = store.memory_bytes
    store.unload([9])
    assert 9 not in store and len(store) == 2 and store.memory_bytes < held
    with pytest.raises(KeyError, match="sample 9 was not loaded"):
        store.get(9)
    store.unload([5, 40])
    assert store.memory_bytes == 0


def _with_broken_image(catalogue_dir: Path, tmp_path: Path, bad_row: int) -> Path:
    copy = Path(shutil.copytree(catalogue_dir, tmp_path / "broken"))
    shard = copy / "data" / "train-00000-of-00002.parquet"
    rows = pq.read_table(shard).to_pylist()
    rows[bad_row]["product_image"] = {"bytes": b"\x89PNG\r\n\x1a\n truncated", "path": None}
    pq.write_table(pa.Table.from_pylist(rows, schema=syn.ARROW_SCHEMA), shard)
    return copy


def test_unbuildable_sample_gets_an_error_naming_it_not_an_exception(catalogue_dir, tmp_path, builder):
    broken = load_catalogue(_with_broken_image(catalogue_dir, tmp_path, bad_row=2))
    store = SampleStore(broken, builder)
    store.load(range(6))
    bad = store.get(2)
    assert bad.prompt is None and bad.error.startswith("sample 2:") and "image" in bad.error
    assert all(store.get(i).prompt is not None for i in (0, 1, 3, 4, 5))


def test_store_works_with_a_plain_per_sample_builder(catalogue_dir, tmp_path, builder):
    broken = load_catalogue(_with_broken_image(catalogue_dir, tmp_path, bad_row=1))
    store = SampleStore(broken, lambda sample: builder(sample))
    store.load([0, 1, 0])
    assert store.get(0).prompt == builder(broken[0])
    assert store.get(1).error.startswith("sample 1:")
    assert len(store) == 2
