"""The protocol registry and the stage configs: every fine-tune protocol pairs with a probe
protocol that selects the same examples for every seed (the runners' own plans compared on
real digits labels), parametrised specs, registration, and configs built from the CLI."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from sklearn.datasets import load_digits

from featcache.core import protocols as P
from featcache.errors import DataError, FeatcacheError, ProbeError, ProtocolError
from featcache.finetune import FinetuneConfig
from featcache.finetune import data as FD
from featcache.finetune import runner as FR
from featcache.probes import ProbeConfig
from featcache.probes import runner as PR


@pytest.fixture(scope="module")
def digits():
    """Real digits labels split into train (1,497) and a val split (300), each with ids."""
    y = load_digits().target
    ids = np.array([f"{i:05d}" for i in range(y.size)])
    return (y[:1497], ids[:1497]), (y[1497:], ids[1497:])


def _probe_split(name, y, ids, offset=0):
    # features = the row's position in train ++ val, so a probe plan's arrays say which rows it took
    return PR.SplitData(name, offset + np.arange(y.size, dtype=np.float64)[:, None], y, ids, 0, "")


def test_every_finetune_protocol_pairs_with_a_probe_protocol_on_the_same_examples(digits):
    (ty, tids), (vy, vids) = digits
    ft_names = P.list_protocols("finetune")
    assert ft_names == ["full", "vtab1k-light"]
    compared = 0
    for name in ft_names:
        ft = P.get_protocol(name, "finetune")
        probe = P.get_protocol(ft.pairs_with, "probe")
        assert probe.pairs_with == ft.name  # the pairing holds both ways
        assert ft.row_protocol == probe.spec  # fine-tune rows carry the probe protocol's name
        assert ft.split == probe.split
        seeds = sorted(set(ft.seeds) | set(probe.seeds) | {0, 1, 2, 7})
        for with_val in (False, True):
            for vs in P.VAL_SOURCES:
                if vs == "official-val" and not with_val:
                    continue
                assert ft.uses_val_split(vs) == probe.uses_val_split(vs)
                use_val = with_val and probe.uses_val_split(vs)
                ptr = _probe_split("train", ty, tids)
                pva = _probe_split("val", vy, vids, offset=ty.size) if use_val else None
                ftr = FD.Split("train", None, np.arange(ty.size), ty, tids, "")
                fva = FD.Split("val", None, np.arange(vy.size), vy, vids, "") if use_val else None
                all_ids = np.concatenate([tids, vids])
                for seed in seeds:
                    pp = PR._plan(probe, seed, ptr, pva, vs)
                    fp = FR.make_plan(ft, seed, ftr, fva, vs)
                    assert pp.train_split == fp.train_split
                    assert pp.info == fp.info
                    for (pX, py), pos in ((pp.tr, fp.train), (pp.va, fp.val), (pp.fin, fp.final)):
                        probe_pos = pX[:, 0].astype(np.int64)
                        # the same rows in the same order, and the labels the probe fits on
                        assert np.array_equal(probe_pos, pos), (name, seed, vs, with_val)
                        assert np.array_equal(all_ids[probe_pos], all_ids[pos])
                        assert np.array_equal(py, np.concatenate([ty, vy])[pos])
                        compared += 1
    assert compared >= 2 * 3 * 4  # both protocols, every part, several seeds


def test_different_seeds_select_different_examples(digits):
    (ty, _), _ = digits
    vt = P.get_protocol("vtab1k-stratified")
    a, b = vt.plan(ty, 0), vt.plan(ty, 1)
    assert not np.array_equal(a.train, b.train)  # the seeded draw: a new 1,000 per seed
    assert a.train.size == 800
    assert a.val.size == 200
    assert a.final.size == 1000


@pytest.mark.slow
@pytest.mark.parametrize(
    ("cache_fixture", "dataset", "limit"),
    [("digits_cache", "digits", None), ("fmnist_cache", "fashion-mnist-small", 2000)],
)
def test_vtab1k_pool_is_fixed_first_800_and_200_in_dataset_order(request, cache_fixture, dataset, limit):
    """VTAB-1k as published: train[:800] and train[800:1000] in the store's row order (the
    reader's order), identical for seeds 0, 1, 2, on the probe side (store) and the fine-tune
    side (images from the reader) alike; ``vtab1k-stratified`` keeps the seeded draw."""
    from featcache.data.readers import open_dataset
    from featcache.store import open_cache

    cache = open_cache(request.getfixturevalue(cache_fixture))
    sd = PR._load_split(cache, "tf_efficientnet_lite0", dataset, "train", "pooled")
    store_ids = np.asarray(cache.split_rows(dataset, "train")[0]).astype(str)
    pos = PR.SplitData(sd.name, np.arange(sd.y.size, dtype=np.float64)[:, None], sd.y, sd.ids, 0, "", rows=sd.rows)
    src = open_dataset("digits" if limit is None else "fashion-mnist")["train"]
    src = src if limit is None else src.subset(limit)
    ft = FD.prepare_split(src, list(src.class_names))
    pools = []
    for seed in (0, 1, 2):
        pp = PR._plan(P.get_protocol("vtab1k"), seed, pos, None, "split-800-200")
        probe_ids = [sd.ids[a[0][:, 0].astype(int)] for a in (pp.tr, pp.va)]
        assert set(probe_ids[0]) == set(store_ids[:800])
        assert set(probe_ids[1]) == set(store_ids[800:1000])
        fp = FR.make_plan("vtab1k-light", seed, ft, None, "split-800-200")
        assert set(ft.ids[fp.train]) == set(store_ids[:800])
        assert set(ft.ids[fp.val]) == set(store_ids[800:1000])
        pools.append(sorted(probe_ids[0]) + sorted(probe_ids[1]))
        assert pp.train_split == fp.train_split == "train[:1000]"
    assert pools[0] == pools[1] == pools[2]
    strat = [set(sd.ids[P.get_protocol("vtab1k-stratified").plan(sd.y, s).final]) for s in (0, 1)]
    assert strat[0] != strat[1]
    if dataset == "digits":  # ids digits-0, digits-1, ...: the dataset order is not the id-sorted one
        assert set(np.sort(sd.ids)[:800]) != set(store_ids[:800])


def test_parametrised_specs_and_defaults():
    fs = P.get_protocol("FewShot:20")
    assert (fs.name, fs.spec, fs.shots, fs.seeds, fs.solver) == ("fewshot", "fewshot:20", 20, (0, 1, 2), "lbfgs")
    sub = P.get_protocol("subset:2.5%")
    assert sub.spec == "subset:2.5%"
    assert sub.fraction == pytest.approx(0.025)
    assert sub.seeds == (0,)
    assert P.get_protocol("salman").grid.decay_epochs() == [50, 100]
    assert P.get_protocol("vtab1k-sgd").grid.milestones(2500) == (833, 1666, 2250)
    assert P.get_protocol("full").grid.Cs == P.C_GRID
    assert len(P.C_GRID) == 45
    # VTAB Figure 16: lightweight fine-tuning pairs with the lightweight SGD linear probe
    assert P.pairs("finetune") == {"full": "full", "vtab1k-light": "vtab1k-sgd"}
    assert P.get_protocol("vtab1k-sgd").grid.drop_remainder
    assert not P.get_protocol("salman").grid.drop_remainder
    with pytest.raises(ProtocolError, match="unknown fine-tuning protocol"):
        P.get_protocol("vtab1k", "finetune")
    with pytest.raises(ProbeError, match="takes no argument"):
        P.get_protocol("salman:3")
    with pytest.raises(DataError, match="stage"):
        P.list_protocols("extract")


def test_register_a_protocol():
    with P.PROTOCOLS["probe"].restored():  # leave the real registry as it was
        _register_and_use_a_protocol()
    assert "fewshot-sgd" not in P.list_protocols()


def _register_and_use_a_protocol():
    @P.register_protocol("fewshot-sgd")
    def fewshot_sgd(arg):
        base = P.get_protocol(f"fewshot:{arg}")
        return P.Protocol(
            spec=f"fewshot-sgd:{base.shots}",
            name="fewshot-sgd",
            stage="probe",
            split="fewshot",
            solver="sgd",
            grid=P.SALMAN_SGD,
            seeds=base.seeds,
            shots=base.shots,
        )

    assert "fewshot-sgd" in P.list_protocols()
    p = P.get_protocol("fewshot-sgd:5")
    y = load_digits().target
    assert np.array_equal(p.plan(y, 3).train, P.get_protocol("fewshot:5").plan(y, 3).train)
    with pytest.raises(ProtocolError, match="already registered"):
        P.register_protocol("fewshot-sgd")(fewshot_sgd)


def test_probe_config_from_the_cli_and_its_run_options():
    from featcache.cli import build_parser
    from featcache.probes.cli import config_from_args

    args = build_parser().parse_args(
        [
            "probe",
            "--cache",
            "a.zarr",
            "--cache",
            "b.zarr",
            "--all",
            "--dataset",
            "digits",
            "--protocol",
            "vtab1k-sgd",
            "--seeds",
            "3,4",
            "--results",
            "r.parquet",
            "--eval-split",
            "test",
            "--eval-split",
            "test_v2",
            "--no-standardize",
            "--epochs",
            "9",
        ]
    )
    cfg = config_from_args(args)
    assert cfg == ProbeConfig(
        ("a.zarr", "b.zarr"),
        "all",
        "digits",
        "vtab1k-sgd",
        seeds=(3, 4),
        results_path="r.parquet",
        eval_splits=("test", "test_v2"),
        standardize=False,
        sgd_epochs=9,
    )
    proto, res = cfg.resolve()
    assert res.vtab_steps == (2500, 10000)
    assert res.last_decay == 0.9
    assert res.seeds == (3, 4)
    # the run id options of the SGD protocol name only what its solver reads
    assert set(res.run_options(proto)) == {
        "vtab_steps",
        "last_decay",
        "sgd_standardize",
        "kind",
        "head_init",
        "train_split",
        "val_source",
    }
    plain = config_from_args(
        build_parser().parse_args(["probe", "--cache", "a", "--backbone", "x", "--dataset", "d", "--results", "r"])
    )
    assert plain == ProbeConfig("a", "x", "d", results_path="r")
    _, res = plain.resolve()
    assert res.seeds == (0,)
    assert res.Cs == P.C_GRID
    assert res.eval_splits == ("test",)
    with pytest.raises(ProbeError, match="--seeds"):
        ProbeConfig("a", "x", "d", seeds="a,b")


def test_finetune_config_from_the_cli_and_scaled_from():
    from featcache.cli import build_parser
    from featcache.finetune.cli import config_from_args

    args = build_parser().parse_args(
        [
            "finetune",
            "--model",
            "m",
            "--data",
            "digits",
            "--results",
            "r",
            "--steps",
            "10,20",
            "--lrs",
            "0.1",
            "--workers",
            "0",
        ]
    )
    cfg = config_from_args(args)
    assert cfg == FinetuneConfig("m", "timm", "digits", results_path="r", steps=(10, 20), lrs=(0.1,), workers=0)
    proto, res = cfg.resolve()
    assert (res.batch_size, res.momentum, res.weight_decay, res.last_decay, res.seeds) == (
        512,
        0.9,
        0.0,
        0.9,
        (0, 1, 2),
    )
    assert res.scaled_from(proto) == {"steps": (2500, 10000), "lrs": (0.1, 0.01)}
    _, full = FinetuneConfig("m", data="digits", protocol="full").resolve()
    assert full.seeds == (0,)
    assert full.steps == (2500, 10000)
    assert full.scaled_from(P.get_protocol("full", "finetune")) == {}
    with pytest.raises(DataError, match="last_decay"):
        FinetuneConfig("m", data="digits", last_decay=1.5).resolve()


def _every_protocol():
    """Every registered protocol of both stages, parametrised ones with a typical argument."""
    for stage in ("probe", "finetune"):
        for name in P.list_protocols(stage):
            for spec in (name, f"{name}:5", f"{name}:10%", f"{name}:vjepa"):
                try:
                    yield P.get_protocol(spec, stage)
                    break
                except FeatcacheError:
                    continue
            else:
                raise AssertionError(f"no spec of {name} builds")


def test_the_protocol_and_the_solver_carry_their_rules_not_the_stages():
    """Whether runs record --val-source and the held-out order are fields of the protocol,
    the fixed settings a solver records a field of the solver: the same values the split and
    solver names gave before, and no stage tests a protocol's or solver's name any more."""
    import featcache
    from featcache.probes.solvers import get_solver

    protocols = list(_every_protocol())
    assert len(protocols) >= 12
    for p in protocols:
        assert p.val_source_choice == p.split.startswith("vtab1k"), p.spec
        assert p.holdout_order == ("dataset" if p.split == "elevater-full" else None), p.spec
        assert get_solver(p.solver).recorded == (
            (("head_loop", "toolkit-stream"),) if p.solver == "elevater" else ()
        ), p.spec
    root = Path(featcache.__file__).parent
    for f in ("probes/config.py", "probes/runner.py", "finetune/config.py", "finetune/runner.py"):
        text = (root / f).read_text()
        for rule in ('.split.startswith("vtab1k")', "proto.split ==", "proto.solver =="):
            assert rule not in text, f"{f} tests a protocol or solver name ({rule})"


def test_a_new_protocol_gets_the_val_source_rule_by_its_field(monkeypatch):
    from dataclasses import replace

    from featcache.probes import ProbeConfig

    vtab = P.get_protocol("vtab1k")
    mine = replace(vtab, spec="my-vtab", name="my-vtab", split="vtab1k", val_source_choice=False)
    cfg = ProbeConfig(
        cache="c.zarr",
        backbones="b",
        dataset="d",
        protocol="vtab1k",
        results_path="r.parquet",
        val_source="official-val",
    )
    assert cfg.run_options(vtab)["val_source"] == "official-val"
    assert "val_source" not in cfg.run_options(mine)  # the field, not the split name, decides
    full = P.get_protocol("full")
    assert cfg.run_options(replace(full, val_source_choice=True))["val_source"] == "official-val"
    assert cfg.run_options(replace(full, holdout_order="dataset"))["holdout_order"] == "dataset"
