"""The protocol registry and the stage configs: every fine-tune protocol pairs with a probe
protocol that selects the same examples for every seed (the runners' own plans compared on
real digits labels), parametrised specs, registration, and configs built from the CLI."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.datasets import load_digits

from featcache import protocols as P
from featcache.errors import DataError, ProbeError, ProtocolError
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
                    assert pp.train_split == fp.train_split and pp.info == fp.info
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
    vt = P.get_protocol("vtab1k")
    a, b = vt.plan(ty, 0), vt.plan(ty, 1)
    assert not np.array_equal(a.train, b.train)  # the pairing test compares real draws
    assert a.train.size == 800 and a.val.size == 200 and a.final.size == 1000


def test_parametrised_specs_and_defaults():
    fs = P.get_protocol("FewShot:20")
    assert (fs.name, fs.spec, fs.shots, fs.seeds, fs.solver) == ("fewshot", "fewshot:20", 20, (0, 1, 2), "lbfgs")
    sub = P.get_protocol("subset:2.5%")
    assert sub.spec == "subset:2.5%" and sub.fraction == pytest.approx(0.025) and sub.seeds == (0,)
    assert P.get_protocol("salman").grid.decay_epochs() == [50, 100]
    assert P.get_protocol("vtab1k-sgd").grid.milestones(2500) == (833, 1666, 2250)
    assert P.get_protocol("full").grid.Cs == P.C_GRID and len(P.C_GRID) == 45
    assert P.pairs("finetune") == {"full": "full", "vtab1k-light": "vtab1k"}
    with pytest.raises(ProtocolError, match="unknown fine-tuning protocol"):
        P.get_protocol("vtab1k", "finetune")
    with pytest.raises(ProbeError, match="takes no argument"):
        P.get_protocol("salman:3")
    with pytest.raises(DataError, match="stage"):
        P.list_protocols("extract")


def test_register_a_protocol(monkeypatch):
    monkeypatch.setattr(P, "_REGISTRY", dict(P._REGISTRY))  # leave the real registry as it was

    @P.register_protocol("fewshot-sgd")
    def fewshot_sgd(arg):
        base = P.get_protocol(f"fewshot:{arg}")
        return P.Protocol(spec=f"fewshot-sgd:{base.shots}", name="fewshot-sgd", stage="probe",
                          split="fewshot", solver="sgd", grid=P.SALMAN_SGD, seeds=base.seeds,
                          shots=base.shots)

    assert "fewshot-sgd" in P.list_protocols()
    p = P.get_protocol("fewshot-sgd:5")
    y = load_digits().target
    assert np.array_equal(p.plan(y, 3).train, P.get_protocol("fewshot:5").plan(y, 3).train)
    with pytest.raises(ProtocolError, match="already registered"):
        P.register_protocol("fewshot-sgd")(fewshot_sgd)


def test_probe_config_from_the_cli_and_its_run_options():
    from featcache.cli import build_parser
    from featcache.probes.cli import config_from_args

    args = build_parser().parse_args(["probe", "--cache", "a.zarr", "--cache", "b.zarr", "--all",
                                      "--dataset", "digits", "--protocol", "vtab1k-sgd", "--seeds", "3,4",
                                      "--results", "r.parquet", "--eval-split", "test", "--eval-split",
                                      "test_v2", "--no-standardize", "--epochs", "9"])
    cfg = config_from_args(args)
    assert cfg == ProbeConfig(("a.zarr", "b.zarr"), "all", "digits", "vtab1k-sgd", seeds=(3, 4),
                              results_path="r.parquet", eval_splits=("test", "test_v2"),
                              standardize=False, sgd_epochs=9)
    proto, res = cfg.resolve()
    assert res.vtab_steps == (2500, 10000) and res.last_decay == 0.9 and res.seeds == (3, 4)
    # the run id options of the SGD protocol name only what its solver reads
    assert set(res.run_options(proto)) == {"vtab_steps", "last_decay", "sgd_standardize", "kind",
                                           "head_init", "train_split", "val_source"}
    plain = config_from_args(build_parser().parse_args(
        ["probe", "--cache", "a", "--backbone", "x", "--dataset", "d", "--results", "r"]))
    assert plain == ProbeConfig("a", "x", "d", results_path="r")
    _, res = plain.resolve()
    assert res.seeds == (0,) and res.Cs == P.C_GRID and res.eval_splits == ("test",)
    with pytest.raises(ProbeError, match="--seeds"):
        ProbeConfig("a", "x", "d", seeds="a,b")


def test_finetune_config_from_the_cli_and_scaled_from():
    from featcache.cli import build_parser
    from featcache.finetune.cli import config_from_args

    args = build_parser().parse_args(["finetune", "--model", "m", "--data", "digits", "--results", "r",
                                      "--steps", "10,20", "--lrs", "0.1", "--workers", "0"])
    cfg = config_from_args(args)
    assert cfg == FinetuneConfig("m", "timm", "digits", results_path="r", steps=(10, 20), lrs=(0.1,), workers=0)
    proto, res = cfg.resolve()
    assert (res.batch_size, res.momentum, res.weight_decay, res.last_decay, res.seeds) == (512, 0.9, 0.0, 0.9, (0, 1, 2))
    assert res.scaled_from(proto) == {"steps": (2500, 10000), "lrs": (0.1, 0.01)}
    _, full = FinetuneConfig("m", data="digits", protocol="full").resolve()
    assert full.seeds == (0,) and full.steps == (2500, 10000) and full.scaled_from(P.get_protocol("full", "finetune")) == {}
    with pytest.raises(DataError, match="last_decay"):
        FinetuneConfig("m", data="digits", last_decay=1.5).resolve()
