"""The rag-kvcache command, run in-process on small sizes (benchmarks' numbers are not
asserted: only that reports are complete and consistent)."""

import json
import os
from pathlib import Path

import pytest
import torch

from rag_kvcache import EngineConfig, RagKVCache
from rag_kvcache.config import StoreConfig
from rag_kvcache.errors import ConfigError
from rag_kvcache.storage.store import TieredStore
from rag_kvcache.tools.cli import main
from rag_kvcache.tools.cli import store as cli_store
from rag_kvcache.tools.cli.documents import unknown_command


@pytest.mark.slow  # the bench's default model is SmolLM2
def test_bench_ttft_writes_a_consistent_report(tmp_path: Path, capsys) -> None:
    assert (
        main(
            [
                "bench",
                "ttft",
                "--dtypes",
                "float32",
                "--contexts",
                "256,512",
                "--strategies",
                "naive,legolink:2",
                "--repeats",
                "1",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    report = json.loads((tmp_path / "ttft.json").read_text())
    assert report["complete"] is True and (tmp_path / "ttft.png").stat().st_size > 10_000
    rows = report["rows"]
    assert [(r["strategy"], r["recomputed_tokens"] > 0) for r in rows[:3]] == [
        ("prefill", True),
        ("naive", False),
        ("legolink:2", True),
    ]
    for row in rows:
        base = next(
            r
            for r in rows
            if r["strategy"] == "prefill" and r["context_tokens"] == row["context_tokens"]
        )
        assert row["speedup"] == pytest.approx(base["ttft_s"] / row["ttft_s"])
    assert report["machine"]["torch"] and "wrote" in capsys.readouterr().out
    # the stage breakdown: one profiled request per context and strategy
    stages = {(r["context_tokens"], r["strategy"]): r for r in report["stages"]}
    assert len(stages) == 6 and (tmp_path / "ttft_stages.png").stat().st_size > 10_000
    for (_, strategy), row in stages.items():
        parts = row["stages"]
        assert set(parts) == {"fetch", "select", "place", "forward", "choose_token", "other"}
        assert parts["forward"] > 0 and parts["choose_token"] > 0
        assert sum(parts.values()) == pytest.approx(row["ttft_s"], rel=0.05)
        assert parts["fetch"] > 0  # prefill reads the chunks' tokens from the store too
        assert (parts["place"] > 0) == (strategy != "prefill")  # only a link places KV


@pytest.mark.slow  # SmolLM2 (and Redis where it is reachable)
def test_bench_store_covers_every_tier(tmp_path: Path) -> None:
    assert (
        main(
            [
                "bench",
                "store",
                "--dtypes",
                "float32",
                "--context",
                "512",
                "--repeats",
                "1",
                "--strategy",
                "naive+reversed+top:1+window:128",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    report = json.loads((tmp_path / "store.json").read_text())
    assert report["strategy"] == "naive+reversed+top:1+window:128"  # timed from every tier
    rows = report["rows"]
    tiers = [r["tier"] for r in rows]
    # redis when reachable; the disk also with its blobs read whole, not layer by layer
    assert tiers[:7] == [
        "prefill",
        "memory",
        "cpu",
        "disk",
        "disk (read whole)",
        "disk-int8",
        "disk-bf16",
    ]
    in_memory = [r for r in rows if r["tier"] in ("prefill", "memory", "cpu")]
    assert all(r["bytes_per_token"] == 46080 for r in in_memory)  # 30 x 3 x 64 x 2 x 4 bytes
    disk = {r["tier"]: r for r in rows}
    assert 46080 <= disk["disk"]["bytes_per_token"] < 47000  # + a small safetensors header
    assert disk["disk-int8"]["bytes_per_token"] < disk["disk"]["bytes_per_token"] / 3.5
    assert disk["disk"]["kl_vs_uncompressed"] == pytest.approx(0, abs=1e-6)  # lossless tier
    assert disk["disk-int8"]["kl_vs_uncompressed"] > 0
    for tier in ("disk", "disk (read whole)", "disk-int8"):  # each timed beside the CPU tier
        beside = disk[tier]["cpu_ttft_beside_s"]
        assert disk[tier]["ttft_vs_cpu"] == pytest.approx(disk[tier]["ttft_s"] / beside)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bench_store_measures_the_bfloat16_durable_tier(dtype, tmp_path: Path) -> None:
    """`bench store`'s disk-bf16 row: half the bytes and a small KL for a float32 model; for a
    bfloat16 model the same blobs as computed (KL 0)."""
    from helpers import TINY_VOCAB, build_tiny
    from tiny_tokenizer import build_tokenizer

    from rag_kvcache.tools.bench.store import bench_dtype

    lm = build_tiny(dtype, tokenizer=build_tokenizer(TINY_VOCAB))
    rows = {r.tier: r for r in bench_dtype(lm, 256, 64, 1, None, tmp_path)}
    disk, half = rows["disk"], rows["disk-bf16"]
    assert half.kl_vs_uncompressed is not None and half.ttft_vs_cpu is not None
    assert disk.kl_vs_uncompressed == pytest.approx(0, abs=1e-9)
    if dtype == torch.float32:
        assert 0.5 < half.bytes_per_token / disk.bytes_per_token < 0.52  # + a small header
        assert 0 < half.kl_vs_uncompressed < 0.1 and half.top1_agrees
    else:
        assert half.bytes_per_token == disk.bytes_per_token
        assert half.kl_vs_uncompressed == pytest.approx(0, abs=1e-9)


def test_store_compress_flag_reaches_the_store_config() -> None:
    import argparse

    from rag_kvcache.config import StoreConfig
    from rag_kvcache.tools.cli.common import engine_options, store_compress

    parser = argparse.ArgumentParser()
    engine_options(parser)
    assert store_compress(parser.parse_args([])) == StoreConfig.compress == "bfloat16"
    assert store_compress(parser.parse_args(["--store-compress", "none"])) is None
    assert store_compress(parser.parse_args(["--store-compress", "int8"])) == "int8"
    assert store_compress(argparse.Namespace()) == "bfloat16"  # a command without the flag


def test_serve_kv_cache_flag_reaches_the_engine_config() -> None:
    from rag_kvcache.tools.cli.common import engine_config
    from rag_kvcache.tools.cli.main import build_parser

    parser = build_parser()
    given = parser.parse_args(["serve", "--store", "s", "--kv-cache-mib", "64"])
    assert engine_config(given).kv_cache_bytes == 64 << 20
    assert engine_config(parser.parse_args(["serve", "--store", "s"])).kv_cache_bytes is None
    assert engine_config(parser.parse_args(["query", "q", "--store", "s"])).kv_cache_bytes is None
    assert engine_config(given).link_budget_s == 0.25  # the default, in seconds
    budget = ["serve", "--store", "s", "--link-budget-ms"]
    assert engine_config(parser.parse_args([*budget, "40"])).link_budget_s == 0.04
    assert engine_config(parser.parse_args([*budget, "none"])).link_budget_s is None
    with pytest.raises(SystemExit):
        parser.parse_args([*budget, "-5"])


def test_strategy_lists_keep_ape_spellings_whole() -> None:
    """`+ape:T,S` holds a comma: a list of strategies splits only where a strategy starts."""
    from rag_kvcache.strategy import Strategy
    from rag_kvcache.tools.cli.main import build_parser

    parser = build_parser()
    listed = "prefill, naive+reversed+top:1+ape:1,0.8,legolink:2+ape:0.7,1.25,legolink:16,"
    spelled = [
        "prefill",
        "naive+reversed+top:1+ape:1,0.8",
        "legolink:2+ape:0.7,1.25",
        "legolink:16",
    ]
    for command in (["eval", "set.jsonl"], ["bench", "ttft"]):
        given = parser.parse_args([*command, "--strategies", listed]).strategies
        assert given == spelled
        assert [str(Strategy.parse(s)) for s in given] == spelled
    assert Strategy.parse(spelled[1]).scale == 0.8
    assert parser.parse_args(["eval", "--strategies", "a,,b"]).strategies == ["a", "b"]


def test_stats_verify_gc_on_a_real_store(tmp_path: Path, tiny64, capsys) -> None:
    from helpers import random_chunks

    from rag_kvcache.link.encoder import encode_chunks

    store = TieredStore(tmp_path)
    store.register_model(tiny64.fingerprint, "tiny", "float64", 3, 2, 16)
    kvs = encode_chunks(tiny64, random_chunks([5, 6], seed=3))
    for kv in kvs:
        store.put(kv, "t")
    store.durable.put(kvs[1].cache_id, b"garbage")
    store.close()
    assert main(["stats", "--store", str(tmp_path)]) == 0
    assert "models / documents / chunks" in capsys.readouterr().out
    assert main(["verify", "--store", str(tmp_path)]) == 1  # one corrupt blob, not repaired
    assert "1 corrupt" in capsys.readouterr().out
    assert main(["gc", "--store", str(tmp_path)]) == 0
    assert "0 orphan blobs" in capsys.readouterr().out


@pytest.mark.slow  # random:tiny carries SmolLM2's tokenizer
@pytest.mark.parametrize(
    ("args", "phrase"),
    [
        (["bench", "serve", "--clients", "0"], "--clients: at least 1, not 0"),  # hung
        (["bench", "serve", "--requests", "0"], "--requests: at least 1, not 0"),
        (["bench", "ttft", "--repeats", "0"], "--repeats: at least 1, not 0"),
        (["bench", "ttft", "--contexts", "abc"], "--contexts: a whole number, not 'abc'"),
        (["bench", "ttft", "--contexts", "100"], "--contexts: at least 256, not 100"),
        (["bench", "store", "--contexts", "4096,4096"], "--contexts: a value is given twice"),
        (["bench", "prefix", "--batches", "0"], "--batches: at least 1, not 0"),
        (["bench", "ingest", "--chunk-tokens", "0"], "--chunk-tokens: at least 1, not 0"),
        (["bench", "memory", "--sizes-mb", "nan"], "--sizes-mb: above 0 and finite, not nan"),
        (["bench", "memory", "--sizes-mb", "-1"], "--sizes-mb: above 0 and finite, not -1"),
        (["bench", "memory", "--sizes-mb", "inf"], "--sizes-mb: above 0 and finite, not inf"),
        (["bench", "ttft", "--dtypes", ","], "--dtypes: no values in ','"),
        (["eval", "x.jsonl", "--limit", "0"], "--limit: at least 1, not 0"),
        (["eval", "--needle", "--depths", "2"], "--depths: from 0 to 1, not 2"),
        (["eval", "--needle", "--depths", "0.5,0.5"], "--depths: a value is given twice"),
        (["eval", "--needle", "--lengths", "-100"], "--lengths: at least 1, not -100"),
        (["eval", "x.jsonl", "--teacher-tokens", "-3"], "--teacher-tokens: at least 0, not -3"),
        (["dataset", "--repeats", "0"], "--repeats: at least 1, not 0"),
        (["dataset", "--repeats", "10000"], "--repeats: at most 100, not 10000"),  # ran for ever
        (["eval", "x.jsonl", "--strategies", ","], "--strategies: no strategies in ','"),
    ],
)
def test_bad_counts_and_lists_are_refused_before_anything_runs(args, phrase, capsys) -> None:
    """Zero, negative, non-numeric or repeated values: argparse's one line naming the flag,
    where they hung (`bench serve --clients 0`), failed after loading the model with a
    traceback, or ran a meaningless case (a context shorter than one chunk)."""
    with pytest.raises(SystemExit) as exited:
        main(args)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert phrase in err and "Traceback" not in err, err


def test_an_out_folder_that_cannot_be_is_one_line_and_paths_print_as_text(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    """--out naming a file, or a folder under one, failed with a traceback (eval's only after
    answering every item); a path holding rich markup such as `[/x]` crashed the last message
    (after the results were written) or lost its brackets."""
    monkeypatch.setenv("COLUMNS", "250")
    file = tmp_path / "afile"
    file.write_text("mine")
    for args in (["eval", "x.jsonl"], ["bench", "ttft"], ["calibrate"], ["dataset"]):
        for out in (file, file / "sub"):
            assert main([*args, "--out", str(out)]) == 1
            err = " ".join(capsys.readouterr().out.split())
            assert err.startswith("error:") and "--out" in err and str(out) in err, err
    assert file.read_text() == "mine"
    odd = tmp_path / "sets[/x][bold]"
    assert main(["dataset", "--out", str(odd), "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert f"{odd}/dev.jsonl" in out and (odd / "dev.jsonl").is_file()


def test_bench_ingest_of_a_missing_path_is_one_line(tmp_path: Path, capsys) -> None:
    """It was a ZeroDivisionError (no chunks, after loading the model)."""
    args = ["bench", "ingest", str(tmp_path / "missing.md"), "--out", str(tmp_path / "r")]
    assert main(args) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert out.startswith("error: nothing at") and "missing.md" in out, out


def test_verify_repairs_with_the_model_that_encoded_the_chunks(tmp_path: Path, capsys) -> None:
    """A store ingested with --model is repaired with that model; repairing with another one
    reports the blobs it cannot rebuild and still checks and repairs the rest."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("The Orrin Vale ferry leaves at 7:40 every morning.")
    (docs / "b.md").write_text("Brindle Hill has a stone tower of 31 meters.")
    store = ["--store", str(tmp_path / "kv")]
    assert main(["ingest", str(docs), *store, "--model", "random:tiny"]) == 0
    opened = TieredStore(tmp_path / "kv", create=False)
    ids = sorted(opened.catalog.documented_ids())
    for cache_id in ids:
        opened.durable.put(cache_id, b"garbage")
    opened.close()
    capsys.readouterr()
    assert main(["verify", *store, "--repair"]) == 1  # the default model: none are its own
    out = " ".join(capsys.readouterr().out.split())
    assert f"{len(ids)} corrupt" in out and "0 repaired" in out and "another model" in out
    assert main(["verify", *store, "--repair", "--model", "random:tiny"]) == 0
    assert f"{len(ids)} repaired" in " ".join(capsys.readouterr().out.split())
    assert main(["verify", *store]) == 0


@pytest.mark.slow  # random:tiny carries SmolLM2's tokenizer
def test_bench_prefix_reports_both_methods_and_their_kv_bytes(tmp_path: Path) -> None:
    args = ["bench", "prefix", "--model", "random:tiny", "--prefixes", "512"]
    args += ["--batches", "1,4", "--new-tokens", "4", "--repeats", "2", "--out", str(tmp_path)]
    assert main(args) == 0
    report = json.loads((tmp_path / "prefix.json").read_text())
    assert report["repeats"] == 2 and (tmp_path / "prefix.png").stat().st_size > 10_000
    assert report["complete"] is True
    rows = {(r["batch"], r["shared"], r["method"]): r for r in report["rows"]}
    assert set(rows) == {
        (b, s, m)
        for b, s in ((1, True), (4, True), (4, False))
        for m in ("prefix tree", "duplicated")
    }
    assert all(r["decode_tokens_per_s"] > 0 for r in rows.values())
    tree, copies = rows[4, True, "prefix tree"], rows[4, True, "duplicated"]
    assert tree["peak_kv_bytes"] < copies["peak_kv_bytes"] / 2  # one copy of the prefix
    # sharing nothing, each request's chunks live once, in its row: as much as the copies,
    # plus one layer of rows while they are laid out (random:tiny has 4 layers), never twice
    tree, copies = rows[4, False, "prefix tree"], rows[4, False, "duplicated"]
    assert tree["peak_kv_bytes"] <= copies["peak_kv_bytes"] * (1 + 1 / 4)


def test_calibrate_trains_keeps_it_in_the_store_and_eval_uses_it(tmp_path: Path) -> None:
    from rag_kvcache.config import EngineConfig, ModelConfig, StoreConfig
    from rag_kvcache.engine import RagKVCache
    from rag_kvcache.link.calibration import Calibration
    from rag_kvcache.model.loading import load_model

    store, out = tmp_path / "store", tmp_path / "cal"
    args = ["calibrate", "--model", "random:tiny", "--items", "2", "--held-out", "1"]
    args += ["--steps", "2", "--answer-tokens", "2", "--store", str(store), "--out", str(out)]
    assert main(args) == 0
    report = json.loads((out / "calibration.json").read_text())
    assert report["config"]["steps"] == 2 and len(report["losses"]) == 2
    assert set(report["kl_held_out"]) == {
        "strategy alone", "initial link tokens", "trained link tokens"
    }  # fmt: skip
    trained = Calibration.load(out / "calibration.safetensors")
    lm = load_model(ModelConfig(path="random:tiny"))
    engine = RagKVCache(EngineConfig(store=StoreConfig(store)), lm=lm)
    assert torch.equal(engine.calibration().vectors.float(), trained.vectors)
    engine.store.close()

    qa = tmp_path / "qa.jsonl"
    item = {"id": "a", "question": "Who?", "answers": ["Ann"],
            "documents": [{"text": "Ann rows."}, {"text": "Bo sings."}]}  # fmt: skip
    qa.write_text(json.dumps(item) + "\n")
    evaluate = ["eval", str(qa), "--model", "random:tiny", "--teacher-tokens", "0"]
    evaluate += ["--max-new-tokens", "2", "--strategies", "naive+calibrated"]
    assert main([*evaluate, "--out", str(tmp_path / "no")]) == 2  # no --calibration given
    calibrated = [
        *evaluate,
        "--out",
        str(tmp_path / "ev"),
        "--calibration",
        str(out / "calibration.safetensors"),
    ]
    assert main(calibrated) == 0
    rows = json.loads((tmp_path / "ev" / "eval.json").read_text())
    assert "naive+calibrated" in rows["strategies"]


def test_calibrate_a_lora_adapter_and_eval_the_adapted_model(tiny32, tmp_path: Path) -> None:
    """`calibrate --kind lora` writes the adapter and keeps it in the store, where
    `--lora store` finds it (`--no-install`: the file only); `eval --lora` answers with the
    model it adapts and records which adapter; an adapter is not trained on top of another."""
    from rag_kvcache.config import EngineConfig, ModelConfig, StoreConfig
    from rag_kvcache.engine import RagKVCache
    from rag_kvcache.errors import CalibrationError
    from rag_kvcache.model.loading import load_model
    from rag_kvcache.model.lora import LinkLoRA

    folder, out, qa = tmp_path / "tiny", tmp_path / "lora", tmp_path / "qa.jsonl"
    tiny32.model.save_pretrained(folder)
    tiny32.tokenizer.save_pretrained(folder)
    items = [
        {"id": name, "question": f"Who is {name}?", "answers": [name],
         "documents": [{"text": f"{name} rows."}, {"text": "Bo sings."}]}
        for name in ("Ann", "Cy", "Di")
    ]  # fmt: skip
    qa.write_text("".join(json.dumps(i) + "\n" for i in items))
    args = ["calibrate", "--kind", "lora", "--rank", "2", "--model", str(folder), "--items", "2"]
    args += ["--held-out", "1", "--steps", "2", "--answer-tokens", "2", "--out", str(out)]
    args += ["--items-file", str(qa)]
    assert main([*args, "--store", str(tmp_path / "store")]) == 0
    report = json.loads((out / "calibration.json").read_text())
    assert report["config"]["kind"] == "lora" and len(report["losses"]) == 2
    assert set(report["kl_held_out"]) == {"strategy alone", "initial adapter", "trained adapter"}
    lora = LinkLoRA.load(out / "lora.safetensors")
    assert lora.rank == 2 and lora.steps == 2
    assert not (out / "calibration.safetensors").exists()
    from_file = load_model(ModelConfig(path=str(folder), lora=str(out / "lora.safetensors")))
    stored = ModelConfig(path=str(folder), lora="store")
    engine = RagKVCache(EngineConfig(model=stored, store=StoreConfig(tmp_path / "store")))
    assert (engine.lm.name, engine.lm.fingerprint) == (from_file.name, from_file.fingerprint)
    assert main([*args, "--store", str(tmp_path / "file-only"), "--no-install"]) == 0
    with pytest.raises(CalibrationError, match="calibrate --kind lora"):
        RagKVCache(EngineConfig(model=stored, store=StoreConfig(tmp_path / "file-only")))
    again = [*args, "--store", str(tmp_path / "s2"), "--lora", str(out / "lora.safetensors")]
    assert main(again) == 2

    evaluate = ["eval", str(qa), "--model", str(folder), "--teacher-tokens", "0"]
    evaluate += ["--max-new-tokens", "2", "--strategies", "naive", "--out", str(tmp_path / "ev")]
    assert main([*evaluate, "--lora", str(out / "lora.safetensors")]) == 0
    rows = json.loads((tmp_path / "ev" / "eval.json").read_text())
    assert "+lora-" in rows["model"] and len(rows["lora"]) == 64


def test_bench_memory_refuses_an_earlier_report_it_cannot_add_to(tmp_path: Path) -> None:
    """Its rows are read back to keep them beside the new ones: a damaged file, or a row of
    the wrong kinds (which failed the plot after the new size was measured), is one error."""
    from rag_kvcache.tools.bench.memory import load_rows

    row = {"model": "m", "dtype": "float32", "file_mb": 0.5, "chunks": 3, "seconds": 1.5}
    row |= {"peak_rss_mb": 300.0, "store_mb": 2.0}
    path = tmp_path / "memory.json"
    path.write_text(json.dumps({"rows": [row]}))
    assert [r.file_mb for r in load_rows(path)] == [0.5]
    for bad in (
        {"file_mb": "5"},
        {"chunks": 2.5},
        {"peak_rss_mb": None},
        {"seconds": -1.0},
        {"store_mb": float("inf")},
        {"model": 7},
        {"chunks": True},
    ):
        path.write_text(json.dumps({"rows": [row | bad]}))
        with pytest.raises(ConfigError, match="not a memory report to add rows to"):
            load_rows(path)
    path.write_bytes(b"\xff{")
    with pytest.raises(ConfigError, match="not a memory report"):
        load_rows(path)


@pytest.mark.slow  # random:tiny carries SmolLM2's tokenizer
def test_bench_memory_measures_the_ingest_command_and_gathers_runs(tmp_path: Path) -> None:
    """Each size is a real `rag-kvcache ingest` in its own process; a second run (another
    dtype) adds its rows beside the first's, and a rerun of the same one replaces its own."""
    from rag_kvcache.tools.bench.memory import write_text

    text = tmp_path / "t.md"
    write_text(text, 20_000, seed=5)
    again = tmp_path / "u.md"
    write_text(again, 20_000, seed=5)
    assert text.read_bytes() == again.read_bytes() and 20_000 <= text.stat().st_size < 22_000
    paragraphs = text.read_text().split("\n\n")
    assert len(set(paragraphs)) == len(paragraphs)  # nothing deduplicated away

    args = ["bench", "memory", "--model", "random:tiny", "--out", str(tmp_path / "r")]
    assert main([*args, "--sizes-mb", "0.01,0.03"]) == 0
    assert main([*args, "--sizes-mb", "0.01", "--dtype", "bfloat16"]) == 0
    first = json.loads((tmp_path / "r" / "memory.json").read_text())["rows"]
    assert main([*args, "--sizes-mb", "0.03"]) == 0  # float32 0.03 again: that row replaced
    report = json.loads((tmp_path / "r" / "memory.json").read_text())
    rows = [(r["dtype"], r["file_mb"]) for r in report["rows"]]
    assert rows == [("bfloat16", 0.01), ("float32", 0.01), ("float32", 0.03)]  # none lost
    kept = next(r for r in first if (r["dtype"], r["file_mb"]) == ("float32", 0.01))
    assert report["rows"][1] == kept  # as it was measured
    small, big = report["rows"][1:]
    assert 0 < small["chunks"] < big["chunks"]  # ~256-token chunks of what was written
    assert all(200 < r["peak_rss_mb"] < 4000 and r["store_mb"] > 0 for r in report["rows"])
    assert (tmp_path / "r" / "memory.png").stat().st_size > 10_000
    assert not [p for p in (tmp_path / "r").iterdir() if p.is_dir()]  # files and stores gone


@pytest.mark.slow  # random:tiny carries SmolLM2's tokenizer
def test_bench_serve_loads_the_server_with_concurrent_and_lone_clients(tmp_path: Path) -> None:
    args = ["bench", "serve", "--model", "random:tiny", "--clients", "3", "--requests", "6"]
    args += ["--context-tokens", "512", "--new-tokens", "4", "--out", str(tmp_path)]
    assert main(args) == 0
    report = json.loads((tmp_path / "serve.json").read_text())
    cases = {(r["context"], r["clients"]): r for r in report["rows"]}
    assert set(cases) == {("shared", 1), ("shared", 3), ("distinct", 1), ("distinct", 3)}
    for row in cases.values():
        assert row["failed"] == 0 and row["requests"] == 6
        assert row["requests_per_s"] > 0 and row["tokens_per_s"] > 0
        assert 0 < row["ttft_p50_s"] <= row["ttft_p95_s"] and row["peak_kv_bytes"] > 0
        assert 0 <= row["stall_p95_s"] < row["seconds"]
    assert cases["shared", 1]["context_tokens"] == 512
    assert cases["distinct", 1]["context_tokens"] == 256  # a quarter each, its own chunks
    assert (tmp_path / "serve.png").stat().st_size > 10_000


def test_help_and_version_answer_without_loading_torch() -> None:
    """Parsing the command line imports no torch / transformers (the package's engine-backed
    names load on first use), so `--help` and `--version` answer at once."""
    import subprocess
    import sys

    from rag_kvcache.tools.cli.documents import counted

    probe = (
        "import sys; from rag_kvcache.tools.cli.main import build_parser; build_parser(); "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert loaded.returncode == 0 and loaded.stdout.strip() == "[]", loaded.stderr
    version = subprocess.run(
        [sys.executable, "-m", "rag_kvcache.tools.cli", "--version"], capture_output=True, text=True
    )
    assert version.returncode == 0 and version.stdout.startswith("rag-kvcache 0.")
    assert (counted(1, "document"), counted(2, "chunk")) == ("1 document", "2 chunks")


def test_every_option_with_a_default_shows_it_in_its_help() -> None:
    import argparse

    from rag_kvcache.tools.cli.main import DefaultsShown, build_parser

    def commands(parser: argparse.ArgumentParser, name: str):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, child in action.choices.items():
                    yield f"{name} {sub}", child
                    yield from commands(child, f"{name} {sub}")

    checked = 0
    for name, parser in commands(build_parser(), "rag-kvcache"):
        assert parser.formatter_class is DefaultsShown, name
        formatter = DefaultsShown(name)
        for action in parser._actions:
            default = action.default
            if not action.option_strings or default is None or default is argparse.SUPPRESS:
                continue
            if default is False:  # a switch: off unless given
                continue
            printed = formatter._get_help_string(action) or ""
            assert "default" in printed, f"{name} {action.option_strings[0]}: {printed!r}"
            if isinstance(default, list):  # lists as the flag takes them
                assert ",".join(map(str, default)) in printed and "[" not in printed
            checked += 1
    assert checked > 60
    ingest = next(p for n, p in commands(build_parser(), "rag-kvcache") if n.endswith("ingest"))
    assert "(default: 256)" in " ".join(ingest.format_help().split())


@pytest.mark.slow
def test_commands_print_no_third_party_progress_bars(tmp_path: Path) -> None:
    """Only our own progress display: no Hugging Face "Loading weights" bars (the model and
    the embedder load in this command)."""
    import os
    import subprocess
    import sys

    (tmp_path / "a.md").write_text(
        "The Hallam Point lighthouse was designed by Mara Quell and first lit in 1788."
    )
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    done = subprocess.run(
        [sys.executable, "-m", "rag_kvcache.tools.cli", "ingest", str(tmp_path / "a.md")]
        + ["--store", str(tmp_path / "store")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 document ingested" in done.stdout
    assert "Loading weights" not in done.stdout + done.stderr
    assert "it/s]" not in done.stdout + done.stderr  # no tqdm bar of any kind


@pytest.mark.slow  # random:tiny carries SmolLM2's tokenizer
@pytest.mark.services
def test_bench_store_stopped_leaves_no_blob_in_redis(tmp_path: Path, monkeypatch) -> None:
    """Its Redis tier's blobs were removed only when the case finished: Ctrl-C in the middle
    left them in the user's Redis for good."""
    import os

    import redis

    from rag_kvcache.storage.redis_tier import RedisTier
    from rag_kvcache.storage.store import TieredStore

    real_get = TieredStore.get

    def stop_at_redis(self, cache_ids):  # type: ignore[no-untyped-def]
        if isinstance(self.durable, RedisTier):  # its blobs are written by now
            assert self.durable.ids()  # (a generator: its keys exist)
            raise KeyboardInterrupt
        return real_get(self, cache_ids)

    monkeypatch.setattr(TieredStore, "get", stop_at_redis)
    args = ["bench", "store", "--model", "random:tiny", "--dtypes", "float32", "--contexts"]
    args += ["256", "--repeats", "1", "--redis-url", "redis://127.0.0.1:6379/14"]
    assert main([*args, "--out", str(tmp_path)]) == 130  # "interrupted"
    client = redis.Redis.from_url("redis://127.0.0.1:6379/14")
    assert list(client.scan_iter(match=f"rag-kvcache-bench:{os.getpid()}:*")) == []


class Stopped(Exception):
    """Stands for a bench killed (a time limit) right after its first report was written."""


@pytest.mark.slow  # random:tiny carries SmolLM2's tokenizer
@pytest.mark.parametrize("bench", ["ttft", "prefix", "store"])
def test_a_bench_stopped_early_keeps_what_it_measured(tmp_path: Path, monkeypatch, bench) -> None:
    """The long benches write their report after every context (ttft) or case (prefix),
    marked incomplete until the last: a run stopped by a time limit or a crash at a size the
    device cannot hold keeps what it measured before."""
    import importlib

    module = importlib.import_module(f"rag_kvcache.tools.bench.{bench}")
    real = module.save_report

    def save_then_stop(*args, **facts):
        real(*args, **facts)
        raise Stopped

    monkeypatch.setattr(module, "save_report", save_then_stop)
    model = ["--model", "random:tiny", "--out", str(tmp_path)]
    args = {
        "ttft": ["--dtypes", "float32", "--contexts", "256,512", "--strategies", "naive"],
        "prefix": ["--prefixes", "256", "--batches", "1,2", "--new-tokens", "2"],
        "store": ["--dtypes", "float32", "--contexts", "256,512", "--strategy", "naive"],
    }[bench]
    with pytest.raises(Stopped):
        main(["bench", bench, *args, "--repeats", "1", *model])
    report = json.loads((tmp_path / f"{bench}.json").read_text())
    assert report["complete"] is False and (tmp_path / f"{bench}.png").stat().st_size > 10_000
    rows = report["rows"]
    if bench == "ttft":  # the first context's prefill and strategy, nothing of the second
        assert [r["strategy"] for r in rows] == ["prefill", "naive"]
        assert len({r["context_tokens"] for r in rows}) == 1
    elif bench == "store":  # the first context's tiers, nothing of the second
        assert rows[0]["tier"] == "prefill" and {"disk", "memory"} <= {r["tier"] for r in rows}
        assert len({r["context_tokens"] for r in rows}) == 1
    else:  # the first case: batch 1, both methods
        assert {(r["batch"], r["method"]) for r in rows} == {(1, "prefix tree"), (1, "duplicated")}


@pytest.mark.slow  # random:tiny carries SmolLM2's tokenizer
def test_bench_ttft_refuses_a_context_past_the_window_before_encoding(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """`--contexts 1000000` encoded chunks up to the window (minutes) before it failed."""
    import rag_kvcache.tools.bench.ttft as ttft

    def encoded(*args: object) -> None:
        raise AssertionError("a chunk was encoded")

    monkeypatch.setattr(ttft, "cache_chunks", encoded)
    args = ["bench", "ttft", "--model", "random:tiny", "--contexts", "512,1000000"]
    assert main([*args, "--strategies", "naive", "--out", str(tmp_path)]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "past random-tiny's window of 32768 tokens" in out and "Traceback" not in out


def test_bad_values_and_ctrl_c_end_a_command_in_one_line(tmp_path: Path, capsys, monkeypatch):
    """An infinite --pending-after, a store path that is not UTF-8, a question that is not
    Unicode, Ctrl-C: each a line saying so (and an exit code), never a traceback."""
    with pytest.raises(SystemExit) as stopped:
        main(["gc", "--store", str(tmp_path), "--pending-after", "inf"])
    assert stopped.value.code == 2 and "finite" in capsys.readouterr().err
    bad = tmp_path / os.fsdecode(b"st\xff")
    assert main(["stats", "--store", str(bad)]) == 1
    out = " ".join(capsys.readouterr().out.split())  # as rich wraps it
    assert "is not valid UTF-8" in out and "Traceback" not in out and not bad.exists()

    def interrupted(args, console) -> int:
        raise KeyboardInterrupt

    missing = tmp_path / "[/x] store"  # text that rich would read as a closing tag
    assert main(["stats", "--store", str(missing)]) == 1
    assert "[/x] store" in " ".join(capsys.readouterr().out.split())

    monkeypatch.setattr(cli_store, "store_command", interrupted)
    assert main(["stats", "--store", str(tmp_path)]) == 130
    assert "interrupted" in capsys.readouterr().out


def test_ctrl_c_while_closing_lets_the_store_close_then_says_interrupted(
    tiny32, tmp_path: Path, monkeypatch, capsys
) -> None:
    """A Ctrl-C that landed inside the store's close cut SQLite's close in two (SQLAlchemy
    logged its traceback above `interrupted`); now it waits for the close, then stops."""
    import signal

    engine = RagKVCache(EngineConfig(store=StoreConfig(root=tmp_path)), lm=tiny32)
    catalog_type = type(engine.store.catalog)
    real_close, closed = catalog_type.close, []

    def pressed_while_closing(self) -> None:  # type: ignore[no-untyped-def]
        os.kill(os.getpid(), signal.SIGINT)  # the handler runs before the next line
        real_close(self)
        closed.append(True)

    def opened_an_engine(args, console) -> int:
        vars(args).setdefault("opened_engines", []).append(engine)  # as `open_engine` does
        return 0

    monkeypatch.setattr(catalog_type, "close", pressed_while_closing)
    monkeypatch.setattr(cli_store, "store_command", opened_an_engine)
    # Python's own Ctrl-C, as in a terminal (a job started in the background by a script has
    # SIGINT ignored, and a Ctrl-C held for it stays ignored: the next test)
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert main(["stats", "--store", str(tmp_path)]) == 130
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the user's again
    finally:
        signal.signal(signal.SIGINT, handler)
    assert closed == [True] and "interrupted" in capsys.readouterr().out


def test_a_second_ctrl_c_while_closing_stops_at_once() -> None:
    """The first Ctrl-C waits for the close; a user who presses again will not wait."""
    import signal

    from rag_kvcache.tools.cli.common import ctrl_c_held

    reached, handler = [], signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt), ctrl_c_held():
        os.kill(os.getpid(), signal.SIGINT)
        reached.append("first held")
        os.kill(os.getpid(), signal.SIGINT)
        reached.append("second held")
    assert reached == ["first held"] and signal.getsignal(signal.SIGINT) is handler


def test_a_ctrl_c_held_goes_to_the_handler_there_was_before() -> None:
    """A process started with SIGINT ignored (a job run in the background by a script) kept
    ignoring it, except while a command closed its stores, where it was raised anyway."""
    import signal

    from rag_kvcache.tools.cli.common import ctrl_c_held

    handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with ctrl_c_held():
            os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # ignored, and still so
        seen: list[int] = []
        signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
        with ctrl_c_held():
            os.kill(os.getpid(), signal.SIGINT)
            assert seen == []  # held while the block runs
        assert seen == [signal.SIGINT]  # then the user's own handler gets it
    finally:
        signal.signal(signal.SIGINT, handler)


def test_a_question_that_is_not_unicode_is_refused(tiny32, tmp_path: Path) -> None:
    """What a shell passes for bytes that are not UTF-8 (lone surrogates) is a ConfigError at
    retrieval and at tokenizing, not a tokenizer's TypeError."""
    engine = RagKVCache(EngineConfig(store=StoreConfig(root=tmp_path)), lm=tiny32)
    for ask in (lambda q: engine.retrieve(q, 1), lambda q: engine.generate(q, [])):
        with pytest.raises(ConfigError, match="not a Unicode character"):
            ask("owls in the barn \udcff\udcfe?")
    with pytest.raises(ConfigError, match="the prompt is empty"):
        engine.complete("")


def test_a_prompt_argument_is_a_file_or_the_prompt_itself(tmp_path: Path) -> None:
    """A prompt too long to be a file name is the prompt (the file system's error is not an
    answer); a file that is not UTF-8 is a MarkupError."""
    from rag_kvcache.markup.language import MarkupError, read_source
    from rag_kvcache.tools.cli.markup import is_file

    assert not is_file('<prompt schema="travel">' + "Tell me more. " * 40 + "</prompt>")
    binary = tmp_path / "bin.xml"
    binary.write_bytes(b"<schema \xf0\x28\x8c\x28>")
    assert is_file(str(binary))
    with pytest.raises(MarkupError, match="not UTF-8 text"):
        read_source(binary)


@pytest.mark.parametrize(
    ("line", "unknown"),
    [
        ("/quti now", True),  # a typo of /quit, with words after it
        ("/hepl", True),
        ("/Help me", True),  # /help: the commands are listed
        ("/frobnicate", True),  # a lone /word is meant as a command
        ("/usr is mounted where?", False),  # a question that starts with a slash is asked
        ("/etc/hosts lists what?", False),
        ("What is /usr?", False),
        ("/quit", True),  # (known commands are handled before this is asked)
    ],
)
def test_chat_tells_unknown_commands_from_questions(line: str, unknown: bool) -> None:
    assert unknown_command(line, line.split()[0].lower()) is unknown
