"""Contract over every stage config (issue 20 item 4): its flags come from ``configs.flag``
metadata, and every field with a flag round-trips (config -> argv -> parsed -> config)."""

from __future__ import annotations

import dataclasses
import re

import pytest

from featcache.cli import build_parser
from featcache.core.configs import choices_of, help_of
from featcache.errors import ConfigError
from featcache.extract.config import ExtractConfig
from featcache.finetune import cli as finetune_cli
from featcache.finetune.config import FinetuneConfig
from featcache.probes import cli as probe_cli
from featcache.probes.config import ProbeConfig
from featcache.retrieval.config import RetrievalConfig
from featcache.sweep import cli as sweep_cli
from featcache.sweep.planner import SweepConfig

# per stage: the command, how its CLI builds the config, the fields set outside the
# config's flags, and a non-default value for every flag that has no choices and is no switch
STAGES = {
    "extract": (
        ExtractConfig,
        lambda a: ExtractConfig.from_args(a),
        {},
        {
            "model": "resnet18",
            "weights": "random:0",
            "data": "fashion-mnist",
            "splits": ("train", "test"),
            "cache": "c.zarr",
            "dataset_name": "dd",
            "backbone_name": "bb",
            "batch_size": 8,
            "workers": 1,
            "threads": 2,
            "device": "cpu",
            "chunk_rows": 16,
            "input_size": 32,
            "pre_resize": 48,
            "features": ("pooled", "cls"),
            "limit": 5,
            "max_image_pixels": 1000,
            "views": 3,
            "view_seed": 9,
            "window_short_side": 40,
        },
    ),
    "probe": (
        ProbeConfig,
        probe_cli.config_from_args,
        {"cache": "c.zarr", "backbones": ("a", "b")},
        {
            "dataset": "dd",
            "protocol": "fewshot:5",
            "seeds": (3, 4),
            "results_path": "r.parquet",
            "predictions": "p.parquet",
            "max_iter": 50,
            "tol": 0.01,
            "max_host_bytes": 4096,
            "eval_splits": ("test", "val"),
            "train_split": "tr",
            "val_split": "va",
            "kind": "cls",
            "head_init": "text",
            "templates": "clip",
            "prompt_dataset": "cifar10",
            "sgd_epochs": 7,
            "views": 2,
            "search_epochs": 2,
            "final_epochs": 3,
            "batch_size": 16,
            "epoch_length": 5,
            "layers": "1,-1",
            "layer_part": "mean",
        },
    ),
    "finetune": (
        FinetuneConfig,
        finetune_cli.config_from_args,
        {},
        {
            "model": "resnet18",
            "weights": "random:0",
            "data": "digits",
            "protocol": "full",
            "seeds": (1, 2),
            "results_path": "r.parquet",
            "steps": (10, 20),
            "lrs": (0.5, 0.05),
            "batch_size": 16,
            "micro_batch": 8,
            "last_decay": 0.8,
            "momentum": 0.5,
            "weight_decay": 0.001,
            "input_size": 32,
            "pre_resize": 32,
            "device": "cpu",
            "eval_splits": ("test", "val"),
            "train_split": "tr",
            "val_split": "va",
            "dataset_name": "dd",
            "backbone_name": "bb",
            "limit": {"train": 5, "test": 3},
            "checkpoint_dir": "ck",
            "checkpoint_every": 7,
            "workers": 1,
            "memory_limit_gb": 0.5,
        },
    ),
    "retrieve": (
        RetrievalConfig,
        RetrievalConfig.from_args,
        {"backbones": ("a", "b")},
        {
            "cache": "c.zarr",
            "dataset": "dd",
            "query_split": "q",
            "gallery_split": "same",
            "ks": (2, 3),
            "relevance": "rel.parquet",
            "max_memory": "512MB",
            "kind": "cls",
            "results_path": "r.parquet",
            "index": "IVF8,Flat",
            "nprobe": 3,
            "ef_search": 24,
            "min_recall": 0.9,
            "index_seed": 2,
            "index_train": 100,
            "index_dir": "idx",
            "recall_queries": 50,
            "shards": 2,
            "scheduler": "tcp://127.0.0.1:8786",
            "layers": "all",
            "layer_part": "cls",
            "layer_val_split": "v",
        },
    ),
    "sweep": (
        SweepConfig,
        sweep_cli.config_from_args,
        {},
        {
            "cache": "c.zarr",
            "results_path": "r.parquet",
            "backbones": ("a", "b"),
            "datasets": ("d",),
            "protocols": ("fewshot:5", "vtab1k"),
            "seeds": (3, 4),
            "finetune": ("full",),
            "data": ("d=digits",),
            "scheduler": "tcp://127.0.0.1:8786",
            "workers": 0,
            "views": 2,
        },
    ),
}


def _flagged(cls):
    return [f for f in dataclasses.fields(cls) if f.metadata.get("cli")]


def _name(f) -> str:
    return f.metadata["name"] or "--" + f.name.replace("_", "-")


def _other_value(f):
    """A value other than the default for a switch or a field with choices (else None)."""
    kw = f.metadata["argparse"]
    if f.metadata["negate"]:
        return False
    if kw.get("action") == "store_true":
        return True
    if "choices" in kw:
        pick = next(c for c in choices_of(f) if c != f.default and (f.default is None or c not in f.default))
        return (pick,) if kw.get("action") == "append" else pick
    return None


def _argv(f, value) -> list[str]:
    """The command-line words that set field ``f`` to ``value``."""
    m = f.metadata
    if m["negate"] or m["argparse"].get("action") == "store_true":
        return [m["negate"] or _name(f)] if value != f.default else []
    if m["argparse"].get("action") == "append":
        return [w for v in value for w in (_name(f), str(v))]
    if isinstance(value, dict):
        return [_name(f), ",".join(f"{k}={v}" for k, v in value.items())]
    if isinstance(value, (tuple, list)):
        return [_name(f), ",".join(map(str, value))]
    return [_name(f), str(value)]


def _who(extra: dict) -> list[str]:
    words = ["--cache", extra["cache"]] if "cache" in extra else []
    return words + [w for b in extra.get("backbones", ()) for w in ("--backbone", b)]


#: a flag that is an older spelling of another field's value (``--compile`` sets ``backend``)
ALIASED_BY = {"backend": ("compile",)}


@pytest.mark.parametrize("command", sorted(STAGES))
def test_every_flag_round_trips(command):
    cls, from_args, extra, samples = STAGES[command]
    values = {}
    for f in _flagged(cls):
        value = samples.get(f.name, _other_value(f))
        assert value is not None, f"{cls.__name__}.{f.name}: add a non-default sample to this contract"
        values[f.name] = value
    want = cls(**extra, **values)
    for f in _flagged(cls):
        if f.default is not dataclasses.MISSING:
            try:
                aliases = [a for a in ALIASED_BY.get(f.name, ()) if a in values]
                reset = {f.name: f.default, **dict.fromkeys(aliases, False)}
                at_default = cls(**extra, **{**values, **reset})
            except ConfigError:  # the default is no valid value (a required flag)
                continue
            assert getattr(want, f.name) != getattr(at_default, f.name), f"{f.name}: the sample is the default"
    argv = [command, *_who(extra)] + [w for f in _flagged(cls) for w in _argv(f, values[f.name])]
    got = from_args(build_parser().parse_args(argv))
    assert {f.name: getattr(got, f.name) for f in dataclasses.fields(cls)} == {
        f.name: getattr(want, f.name) for f in dataclasses.fields(cls)
    }


@pytest.mark.parametrize("command", sorted(STAGES))
def test_parser_is_built_from_the_config(command):
    cls = STAGES[command][0]
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices[command]
    by_dest = {a.dest: a for a in sub._actions}
    for f in _flagged(cls):
        action = by_dest[f.name]
        assert (f.metadata["negate"] or _name(f)) in action.option_strings
        assert (help_of(f) or "").split(" (default")[0][:40] in (action.help or "").replace("%%", "%")


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["extract", "--model", "m", "--data", "digits", "--cache", "c", "--batch-size", "0"], "--batch-size"),
        (["extract", "--model", "m", "--data", "digits", "--cache", "c", "--device", "gpu"], "--device"),
        (["extract", "--model", "m", "--data", "digits", "--cache", "c", "--dataset-name", "a/b"], "--dataset-name"),
    ],
)
def test_invalid_flag_value_is_a_config_error_naming_the_flag(argv, flag):
    with pytest.raises(ConfigError, match=flag):
        ExtractConfig.from_args(build_parser().parse_args(argv))


@pytest.mark.parametrize(
    ("cls", "kw", "match"),
    [
        (ExtractConfig, {"model": "m", "input_size": 0}, "input-size"),
        (RetrievalConfig, {"cache": "c", "dataset": "d", "metric": "hamming"}, "similarity"),
        (RetrievalConfig, {"cache": "c", "dataset": "d", "ks": (0,)}, "ks"),
        (RetrievalConfig, {"cache": "c", "dataset": "d", "backend": "annoy"}, "backend"),
        (ProbeConfig, {"cache": "c", "backbones": "all", "dataset": "d", "seeds": ()}, "seeds is empty"),
        (ProbeConfig, {"cache": "c", "backbones": "all", "dataset": "d", "final_epoch": "best"}, "final_epoch"),
    ],
)
def test_invalid_python_value_is_a_config_error(cls, kw, match):
    def build():
        cfg = cls(**kw)
        return cfg.resolve() if isinstance(cfg, ProbeConfig) else cfg  # checked against its protocol

    with pytest.raises(ConfigError, match=match):
        build()


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"dtype": "float64"}, "--dtype float64 is invalid: choose float16 or float32"),
        ({"amp": "int8"}, "--precision int8 is invalid: choose default, auto, fp32, bf16 or fp16"),
        ({"decoder": "cv2"}, "--decoder cv2 is invalid: choose auto, pil or torchvision"),
        ({"workers": -1}, "--workers -1 is invalid: must be an integer >= 0"),
        ({"batch_size": 2.5}, "--batch-size 2.5 is invalid: must be an integer >= 1"),
        ({"device": 3}, "--device 3 is invalid: choose auto, cpu, cuda or cuda:N"),
        ({"pre_resize": 4097}, "--pre-resize 4097 is invalid: must be at most 4096 pixels a side"),
    ],
)
def test_declared_field_constraints_name_the_flag(kw, match):
    with pytest.raises(ConfigError, match=re.escape(match)):
        ExtractConfig("m", **kw)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"steps": (0,)}, "steps must be positive"),
        ({"lrs": (-0.1,)}, "learning rates"),
        ({"checkpoint_every": 0}, "checkpoint_every"),
    ],
)
def test_invalid_finetune_value_is_a_config_error_and_still_a_data_error(kw, match):
    from featcache.errors import DataError

    cfg = FinetuneConfig(model="m", data="digits", **kw)
    with pytest.raises(ConfigError, match=match) as err:
        cfg.resolve()
    assert isinstance(err.value, DataError)


def test_sweep_items_read_results_path_of_every_stage_without_a_deprecation(recwarn):
    from featcache.sweep.planner import WorkItem

    cfg = RetrievalConfig(cache="c", dataset="d", results_path="r.parquet")
    probe = ProbeConfig(cache="c", backbones=("a",), dataset="d", results_path="p.parquet")
    for kind, config, want in (("retrieval", cfg, "r.parquet"), ("probe", probe, "p.parquet")):
        assert WorkItem(kind, "id", config, (), "a", "d", "semantic").results == want
    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning)]


def test_sweep_config_results_path_and_its_deprecated_alias():
    from featcache.sweep import SweepConfig

    cfg = SweepConfig(cache="c", results_path="r.parquet")
    with pytest.warns(DeprecationWarning, match="results_path"):
        assert SweepConfig(cache="c", results="r.parquet") == cfg
    with pytest.warns(DeprecationWarning, match="results_path"):
        assert cfg.results == "r.parquet"


def _sweep(*words: str) -> SweepConfig:
    return sweep_cli.config_from_args(build_parser().parse_args(["sweep", "--cache", "c", "--results", "r", *words]))


def test_sweep_cli_defaults_and_derived_fields():
    """The sweep's flags as before they came from SweepConfig: no --protocol is ``full``, or
    none with --retrieval/--finetune; the --ft-* flags give finetune_options; --data and
    --seeds are parsed (a bad value is a SweepError naming the flag)."""
    from featcache.errors import SweepError

    assert _sweep() == SweepConfig("c", "r", protocols=("full",), workers=2)
    assert _sweep("--retrieval").protocols == ()
    assert _sweep("--finetune", "full", "--data", "d=digits").protocols == ()
    assert _sweep("--retrieval", "--protocol", "salman").protocols == ("salman",)
    got = _sweep("--finetune", "full", "--data", "d=x", "--data", "d=digits", "--ft-steps", "2,4", "--ft-lrs", "0.1")
    assert got.data == (("d", "digits"),)  # a later NAME wins
    assert dict(got.finetune_options) == {"steps": (2, 4), "lrs": (0.1,)}
    got = _sweep("--ft-batch-size", "16", "--ft-input-size", "32", "--ft-limit", "100")
    assert dict(got.finetune_options) == {"batch_size": 16, "input_size": 32, "limit": 100}
    with pytest.raises(SweepError, match=r"--data takes NAME=SPEC"):
        _sweep("--data", "digits")
    with pytest.raises(SweepError, match=r"--seeds must be comma-separated integers"):
        _sweep("--seeds", "a,b")
    with pytest.raises(SweepError, match=r"seeds is empty"):
        _sweep("--seeds", ",")
