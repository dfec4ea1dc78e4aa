"""featcache export / import (issue 58): each format round-trips a results table made by real
probe runs on the digits store, is read by its own tool's reader, and matches what that tool's
own writer writes for the same values."""

from __future__ import annotations

import ast
import csv
import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest

from featcache.analysis import load_results
from featcache.cli import main
from featcache.core.results import read_results
from featcache.errors import ResultsError
from featcache.interop import RESULT_FORMATS, ExportConfig, ImportConfig, export_results, import_results, read_external
from featcache.interop.cli import EXPORT_FORMATS, IMPORT_FORMATS
from featcache.interop.runs import RUN_COLUMNS

pytestmark = pytest.mark.slow

LITE0 = "tf_efficientnet_lite0"
DATA = Path(__file__).parent / "data"
#: run-level columns an import restores from featcache's provenance (run_id: a new one, hparams: plus `external`)
KEPT = [c for c in RUN_COLUMNS if c not in ("run_id", "hparams")]


@pytest.fixture(scope="module")
def table(digits_cache, tmp_path_factory) -> Path:
    """Real probe runs on the digits store: the full protocol (seed 0) and 5-shot (seeds 0, 1)."""
    out = tmp_path_factory.mktemp("interop") / "results.parquet"
    for protocol, seeds in (("full", "0"), ("fewshot:5", "0,1")):
        argv = ["-q", "probe", "--cache", digits_cache, "--all", "--dataset", "digits", "--protocol", protocol]
        assert main([*argv, "--seeds", seeds, "--results", str(out), "--no-progress"]) == 0
    return out


@pytest.fixture(scope="module")
def exported(table, digits_cache, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("exported")
    for fmt in EXPORT_FORMATS:
        export_results(ExportConfig(str(table), str(root / fmt), fmt, caches=(digits_cache,)))
    return {fmt: root / fmt for fmt in EXPORT_FORMATS}


def test_the_cli_offers_what_the_registry_holds():
    assert set(IMPORT_FORMATS) - {"auto"} == set(RESULT_FORMATS)
    assert {n for n in RESULT_FORMATS if RESULT_FORMATS[n].write is not None} == set(EXPORT_FORMATS)


@pytest.mark.parametrize("fmt", EXPORT_FORMATS)
def test_export_then_import_gives_the_same_rows(fmt, table, exported):
    """Every row comes back with its run-level columns and value (MTEB's: rounded to 6 places,
    as mteb's to_disk writes them), marked external with the run it came from."""
    own = read_results(table)
    name, got, problems = read_external(exported[fmt])
    assert (name, problems) == (fmt, ())
    assert got.height == own.height
    by_key = {(json.loads(r["hparams"])["external"]["run_id"], r["metric"]): r for r in got.iter_rows(named=True)}
    tol = 5e-7 if fmt == "mteb" else 0.0
    for r in own.iter_rows(named=True):
        back = by_key[(r["run_id"], r["metric"])]
        assert {c: back[c] for c in KEPT} == {c: r[c] for c in KEPT}
        assert back["value"] == pytest.approx(r["value"], abs=tol, rel=0)
        hp = json.loads(back["hparams"])
        assert hp.pop("external")["format"] == fmt
        assert hp == json.loads(r["hparams"])
        assert back["run_id"] != r["run_id"]


def _clip_benchmark_build():
    """clip_benchmark 1.6.2's own ``main_build`` (clip_benchmark/cli.py:89), taken from the
    installed file's text (importing clip_benchmark.cli imports torch, open_clip and its
    datasets: seconds)."""
    spec = importlib.util.find_spec("clip_benchmark")
    if spec is None:
        pytest.skip("clip_benchmark is not installed (the test extra installs it)")
    src = (Path(spec.submodule_search_locations[0]) / "cli.py").read_text()
    fn = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == "main_build")
    ns = {"json": json, "csv": csv, "os": __import__("os")}
    exec(compile(ast.Module([fn], []), "clip_benchmark/cli.py", "exec"), ns)
    return ns["main_build"]


def test_clip_benchmark_build_merges_the_export(table, exported, tmp_path):
    import argparse

    out = tmp_path / "benchmark.csv"
    _clip_benchmark_build()(argparse.Namespace(files=[str(exported["clip_benchmark"])], output=str(out)))
    rows = list(csv.DictReader(out.open()))
    own = read_results(table)
    assert len(rows) == own["run_id"].n_unique()
    for row in rows:
        run = own.filter(own["run_id"] == ast.literal_eval(row["featcache"])["run_id"])  # build: str(dict)
        top1 = run.filter(run["metric"] == "top1")["value"][0]
        assert (row["task"], row["dataset"], row["language"]) == ("linear_probe", "digits", "en")
        assert float(row["lp_acc1"]) == top1
        assert 0 <= top1 <= 1
        assert row["model_fullname"] == f"{LITE0} {row['pretrained']}"


def test_clip_benchmark_file_is_its_dump(exported):
    """The file is clip_benchmark's ``json.dump(dump, f)`` of ``{dataset, model, pretrained,
    task, metrics, language}`` (cli.py:404-420), featcache's block after those keys."""
    for path in exported["clip_benchmark"].glob("*.json"):
        data = json.loads(path.read_text())
        dump = {k: data[k] for k in ("dataset", "model", "pretrained", "task", "metrics", "language")}
        assert path.read_text().startswith(json.dumps(dump)[:-1] + ', "featcache": ')
        assert data["pretrained"] == data["featcache"]["weights_sha256"][:12]


@pytest.fixture(scope="module")
def mteb_mod():
    return pytest.importorskip("mteb")


def test_mteb_reads_the_export_and_writes_the_same_bytes(mteb_mod, exported, tmp_path):
    from mteb.cache import ResultCache
    from mteb.models.model_meta import ModelMeta
    from mteb.results.task_result import TaskResult

    root = exported["mteb"]
    files = sorted(p for p in root.rglob("*.json") if p.name != "model_meta.json")
    rev = next(root.rglob("model_meta.json")).parent
    assert sorted(files) == sorted([rev / "digits.json", rev / "experiments" / "probe-fewshot-5" / "digits.json"])
    for path in files:
        res = TaskResult.from_disk(path)
        golden = tmp_path / path.name
        TaskResult.model_validate(json.loads(path.read_text())).to_disk(golden)
        assert golden.read_text() == path.read_text()
        entry = json.loads(path.read_text())["scores"]["test"][0]
        assert res.get_score() == entry["main_score"]
        assert not res.dataset_revision.startswith(("69a", "cf6"))
        assert res.dataset_revision.startswith("featcache:")
    meta_path = next(root.rglob("model_meta.json"))
    meta = json.loads(meta_path.read_text())
    mine = ModelMeta(**{k: v for k, v in meta.items() if k not in ("is_cross_encoder",)})
    assert json.loads(json.dumps(mine.to_dict(), default=str)) == meta
    cache = ResultCache(cache_path=root)
    full = cache.load_task_result("digits", meta["name"], meta["revision"], raise_if_not_found=True)
    five = cache.load_task_result("digits", meta["name"], meta["revision"], experiment_name="probe-fewshot-5")
    assert len(five.scores["test"][0]["scores_per_experiment"]) == 2  # two seeds: MTEB's experiments
    assert full.task_name == "digits"  # no MIEB task: featcache's name


def test_mieb_task_names_are_mtebs(mteb_mod):
    from featcache.interop.mteb_format import MIEB_TASKS, ZERO_SHOT, task_name

    cls = {t.metadata.name: t.metadata.type for t in mteb_mod.get_tasks(task_types=["ImageClassification"])}
    zs = {t.metadata.name for t in mteb_mod.get_tasks(task_types=["ZeroShotClassification"])}
    assert set(MIEB_TASKS.values()) <= set(cls)
    assert set(ZERO_SHOT.values()) <= zs
    names = [task_name(*a) for a in (("CIFAR-10", "full"), ("mnist", "zeroshot"), ("digits", "full"))]
    assert names == ["CIFAR10", "MNISTZeroShot", "digits"]
    assert task_name("cifar10", "full", "retrieval") == "cifar10"  # MIEB's CIFAR10 classifies


def test_lm_eval_reads_the_export(table, exported):
    utils = pytest.importorskip("lm_eval.utils")
    from lm_eval.api.metrics import mean_stderr

    files = [str(p) for p in exported["lm-eval"].rglob("*.json")]
    assert utils.get_results_filenames(files) == files
    latest = utils.get_latest_filename(files)
    data = json.loads(Path(latest).read_text())
    assert utils.make_table(data).count("|acc") == len(data["results"])  # lm-eval's own table
    own = read_results(table)
    for task, res in data["results"].items():
        block = data["configs"][task]["metadata"]["featcache"]
        n = block["n_eval"]
        top1 = own.filter((own["run_id"] == block["run_id"]) & (own["metric"] == "top1"))["value"][0]
        k = round(top1 * n)
        assert res["acc,none"] == top1
        assert data["higher_is_better"][task]["acc"] is True
        assert data["higher_is_better"][task]["nll"] is False
        assert res["acc_stderr,none"] == pytest.approx(mean_stderr([1.0] * k + [0.0] * (n - k)), rel=1e-12)


def test_lm_eval_file_is_what_its_tracker_writes(exported, tmp_path):
    """lm-eval's own ``EvaluationTracker.save_results_aggregated`` (lm_eval 0.4.13,
    loggers/evaluation_tracker.py:230), given the export's results and the same model, writes
    the same keys in the same order and the same values (but its own timer's total time)."""
    tracking = pytest.importorskip("lm_eval.loggers.evaluation_tracker")

    ours_path = next(exported["lm-eval"].rglob("results_*.json"))
    ours = json.loads(ours_path.read_text())
    tracker = tracking.EvaluationTracker(output_path=str(tmp_path))
    tracker.general_config_tracker.log_experiment_args(
        model_source="featcache",
        model_args={"model": ours["model_name"]},
        system_instruction=None,
        chat_template=None,
        fewshot_as_multiturn=False,
    )
    tracked = set(dataclasses.asdict(tracker.general_config_tracker)) | {"task_hashes"}
    tracker.save_results_aggregated(results={k: v for k, v in ours.items() if k not in tracked}, samples=None)
    golden_path = next(tmp_path.rglob("results_*.json"))
    golden = json.loads(golden_path.read_text())
    assert golden_path.parent.name == ours_path.parent.name  # the model's sanitized folder
    assert list(golden) == list(ours)
    for d in (golden, ours):
        d.pop("total_evaluation_time_seconds")
    assert golden == ours


def test_the_hub_reads_the_model_card(exported):
    from huggingface_hub import metadata_load
    from huggingface_hub.repocard_data import eval_results_to_model_index, model_index_to_eval_results

    card = next(exported["model-index"].rglob("README.md"))
    meta = metadata_load(card)
    name, evals = model_index_to_eval_results(meta["model-index"])
    assert name == f"featcache/{LITE0}"
    assert eval_results_to_model_index(name, evals) == meta["model-index"]  # the Hub's own writer
    top1 = [e for e in evals if e.metric_type == "accuracy"]
    assert top1
    assert all(e.task_type == "image-classification" and 0 <= e.metric_value <= 1 for e in top1)


def test_timm_csv_rows_become_external_finetune_rows(tmp_path):
    """A real excerpt of timm's results-imagenet.csv (huggingface/pytorch-image-models,
    0173a139a2c66db3a41ebfe1d8ac4fb02483642e, results/results-imagenet.csv, its first rows and
    the tf_efficientnet_l2 row), one row damaged: that row is one line naming file and field."""
    bad = tmp_path / "results-imagenet.csv"
    lines = (DATA / "results-imagenet.csv").read_text().splitlines()
    lines[2] = lines[2].replace("10.034", "11.034")
    bad.write_text("\n".join(lines) + "\n")
    results = tmp_path / "r.parquet"
    rep = import_results(ImportConfig(str(bad), str(results)))
    assert rep.format == "timm"
    assert rep.runs == 4
    assert rep.problems == (f"{bad}: line 3, field top1_err: top1 89.966 + top1_err 11.034 is not 100",)
    df = read_results(results)
    eva = df.filter((df["backbone"] == "eva_giant_patch14_560.m30m_ft_in22k_in1k") & (df["metric"] == "top1"))
    assert eva["value"][0] == pytest.approx(0.89786, abs=1e-12)
    assert (eva["kind"][0], eva["protocol"][0], eva["eval_split"][0]) == ("finetune", "full", "val")
    assert json.loads(eva["hparams"][0])["param_count"] == "1,014.45"


def test_bad_files_are_one_line_each_and_leave_the_table(tmp_path, table):
    results = tmp_path / "r.parquet"
    results.write_bytes(table.read_bytes())
    before = results.read_bytes()
    src = tmp_path / "cb"
    src.mkdir()
    dump = {"dataset": "cifar10", "model": "ViT-B-32", "pretrained": "openai", "task": "linear_probe", "language": "en"}
    (src / "a.json").write_text(json.dumps({**dump, "metrics": {"lp_acc1": 93.2}}))
    (src / "b.json").write_text(json.dumps({**dump, "task": "zeroshot_retrieval", "metrics": {}}))
    with pytest.raises(ResultsError, match="no result rows"):
        import_results(ImportConfig(str(src), str(results), "clip_benchmark"))
    assert results.read_bytes() == before
    _, _, problems = read_external(src, "clip_benchmark")
    assert problems == (
        f"{src / 'a.json'}: field 'metrics.lp_acc1' is 93.2, not a fraction in [0, 1]",
        f"{src / 'b.json'}: field 'task' is 'zeroshot_retrieval'; featcache reads ['linear_probe', 'zeroshot_classification']",
    )
    (src / "c.json").write_text(json.dumps({**dump, "metrics": {"lp_acc1": 0.932, "seed": 0, "fewshot_k": -1}}))
    rep = import_results(ImportConfig(str(src), str(results)))
    assert (rep.rows, len(rep.problems)) == (1, 2)


def test_analysis_puts_external_rows_beside_featcaches(tmp_path, table, exported):
    """Imported rows are their own source in the analysis; a run exported and imported back
    is counted once."""
    results = tmp_path / "r.parquet"
    results.write_bytes(table.read_bytes())
    import_results(ImportConfig(str(exported["lm-eval"]), str(results)))
    import_results(ImportConfig(str(DATA / "results-imagenet.csv"), str(results)))
    rows = load_results(results, metric="top1").rows
    assert set(rows["source"].unique()) == {"r.parquet", "results-imagenet.csv (external)"}
    assert rows.filter(rows["source"] == "r.parquet").height == read_results(table).height


def test_linear_vs_finetune_pairs_featcache_probes_with_timms_numbers(tmp_path):
    """timm's published ImageNet accuracy is the fine-tune side of a backbone whose featcache
    linear probe on imagenet/val is in the table (the probe rows here are given, the pairing is
    what is tested)."""
    from featcache.analysis.rankings import linear_vs_finetune
    from featcache.analysis.tables import reduce_seeds
    from featcache.core.results import append_results

    results = tmp_path / "r.parquet"
    names = ["eva02_large_patch14_448.mim_m38m_ft_in22k_in1k", "tf_efficientnet_l2.ns_jft_in1k"]
    probe = {"kind": "probe", "dataset": "imagenet", "protocol": "full", "eval_split": "val", "metric": "top1"}
    append_results(
        results, [{**probe, "run_id": f"p{i}", "backbone": b, "value": 0.8 + i / 100} for i, b in enumerate(names)]
    )
    import_results(ImportConfig(str(DATA / "results-imagenet.csv"), str(results)))
    out = linear_vs_finetune(reduce_seeds(load_results(results, metric="top1").rows))
    pairs = {r["backbone"]: (r["linear"], r["finetune"]) for r in out.pairs.iter_rows(named=True)}
    assert pairs == {names[0]: (0.8, pytest.approx(0.90052)), names[1]: (0.81, pytest.approx(0.88352))}


def test_the_commands(table, tmp_path, capsys):
    out, results = tmp_path / "cb", tmp_path / "r.parquet"
    assert main(["export", "--format", "clip_benchmark", "--results", str(table), "--out", str(out)]) == 0
    assert capsys.readouterr().out == f"3 run(s) -> 3 file(s) under {out} (clip_benchmark)\n"
    assert main(["import", str(out), "--results", str(results)]) == 0
    assert capsys.readouterr().out == f"3 external run(s), 15 row(s) (clip_benchmark) -> {results}\n"
    (tmp_path / "notes.txt").write_text("top1 0.9\n")
    with pytest.raises(ResultsError, match=r"notes.txt looks like no format; name it with --format"):
        import_results(ImportConfig(str(tmp_path / "notes.txt"), str(results)))
    with pytest.raises(ResultsError, match=r"result format 'timm' is read only"):
        export_results(ExportConfig(str(table), str(out), "timm"))
    with pytest.raises(ResultsError, match=r"clip-benchmark"):
        export_results(ExportConfig(str(table), str(out), "clip-benchmark"))


def test_a_folder_mteb_itself_wrote_is_imported(mteb_mod, tmp_path):
    """A MIEB result saved by mteb's own ResultCache.save_to_cache (TaskResult.to_disk and
    model_meta.json): one probe row per split from its accuracy, MIEB's task named back as
    featcache's dataset, the model by model_meta's name, protocol ``mteb``."""
    from mteb.cache import ResultCache
    from mteb.models.model_meta import ModelMeta
    from mteb.results.task_result import TaskResult

    meta = ModelMeta(loader=None, name="org/vit-tiny", revision="0123abcd", release_date=None, languages=None,
                     n_parameters=None, memory_usage_mb=None, max_tokens=None, embed_dim=192, license=None,
                     open_weights=True, public_training_code=None, public_training_data=None, framework=["PyTorch"],
                     similarity_fn_name=None, use_instructions=None, training_datasets=None, modalities=["image"])  # fmt: skip
    entry = {"accuracy": 0.91234567, "f1": 0.9, "main_score": 0.91234567, "hf_subset": "default"}
    res = TaskResult(dataset_revision="69a62dd171e24a133d193073e73fda4dbb823266", task_name="CIFAR10",
                     mteb_version="2.26.24", scores={"test": [{**entry, "languages": ["eng-Latn"]}]},
                     evaluation_time=12.5)  # fmt: skip
    ResultCache(cache_path=tmp_path).save_to_cache(res, meta)
    name, rows, problems = read_external(tmp_path / "results")
    assert (name, problems, rows.height) == ("mteb", (), 1)
    row = rows.row(0, named=True)
    assert (row["kind"], row["backbone"], row["dataset"], row["protocol"]) == (
        "probe",
        "org/vit-tiny",
        "cifar10",
        "mteb",
    )
    assert (row["metric"], row["value"], row["eval_split"]) == ("top1", 0.912346, "test")  # to_disk's 6 places
    hp = json.loads(row["hparams"])
    assert (hp["mteb_task"], hp["model_revision"], hp["dataset_revision"][:3]) == ("CIFAR10", "0123abcd", "69a")
