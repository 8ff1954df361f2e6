"""Policy decisions never leave a rank blocked in one long collective (issue 21), on real gloo.

The waits asserted are the ones :class:`adacomp.policies.rendezvous.Rendezvous` records around
each collective call (seconds inside that one call), not the test's wall-clock time.
"""
from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from tests._dist import run_workers

BIG = 10_000  # a BIG x BIG linear layer: 100M elements (VGG-16's first classifier layer is 103M)


class OneHugeLayer(nn.Module):
    """16 -> 10k -> 10k -> 4: one 100M-element weight and three small tensors, cheap to run."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, BIG)
        self.huge = nn.Linear(BIG, BIG, bias=False)
        self.out = nn.Linear(BIG, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.huge(torch.relu(self.inp(x)))))


def _huge_bytecomp_worker() -> dict:
    import adacomp
    adacomp.init(backend="torch")
    torch.manual_seed(0)  # identical models on both ranks without a 400 MB broadcast
    with torch.no_grad():
        model = OneHugeLayer()
    cfg = {"compressor": {"name": "topk", "density": 0.001}, "memory": {"name": "none"},
           "communicator": {"name": "allgather"}, "fusion": {"bucket_mb": 0},
           "policy": {"name": "bytecomp", "profile_steps": 2}}  # alpha / beta measured, as a user would
    opt = adacomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                       named_parameters=model.named_parameters(), config=cfg)
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(adacomp.rank()))
    for _ in range(3):  # two profiling steps, the decision, one step on the plan
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    pol = opt.policy
    routes = {n: opt.route_of(n).compressor.name for n in pol.plan}
    out = {"plan": dict(pol.plan), "routes": routes, "waits": list(pol.rendezvous.waits),
           "decision_s": pol.rendezvous.decision_s, "max_wait_s": pol.rendezvous.max_wait_s,
           "timeout_s": pol.rendezvous.timeout_s}
    opt.remove_hooks()
    adacomp.shutdown()
    return out


def test_plan_for_a_100m_element_tensor_without_long_collective_waits():
    r0, r1 = run_workers(_huge_bytecomp_worker, 2, timeout=300)
    assert r0["plan"] == r1["plan"] and "huge.weight" in r0["plan"]
    for r in (r0, r1):
        assert {n: ("none" if o == "none" else "topk") for n, o in r["plan"].items()} == r["routes"]  # applied
        assert any(what == "the plan decision" for what, _ in r["waits"])
        assert r["max_wait_s"] < 10.0, r["waits"]
    assert r1["decision_s"] == r0["decision_s"] > 0


def _decision_modes_worker() -> dict:
    """Collective timeout 2 s, three decisions in turn: rank 0 works 4 s ('slow'), raises
    ('error'), then never joins the broadcast ('hung', last: it breaks the group)."""
    import adacomp
    from adacomp.policies.rendezvous import Rendezvous
    be = adacomp.init(backend="torch", timeout_s=2.0)
    out: dict[str, dict] = {}
    for mode in ("slow", "error", "hung"):
        rv = Rendezvous(be, "bytecomp", timeout_s=2.0)

        def decision() -> dict:
            if mode == "error":
                raise ValueError("no plan")
            time.sleep(4.0)
            return {"plan": "ok"}
        try:
            if mode == "hung" and be.rank() == 0:
                time.sleep(5.0)  # busy without the progress loop: what every policy did before issue 21
                out[mode] = {"error": None}
                continue
            result = rv.decide("the plan decision", decision)
        except Exception as exc:  # noqa: BLE001 - the message is what the test checks
            out[mode] = {"error": f"{type(exc).__name__}: {exc}", "max_wait_s": rv.max_wait_s}
            continue
        out[mode] = {"result": result, "rounds": rv.rounds, "waits": list(rv.waits), "max_wait_s": rv.max_wait_s,
                     "decision_s": rv.decision_s, "interval_s": rv.interval_s}
    return out


@pytest.fixture(scope="module")
def modes() -> list[dict]:
    return run_workers(_decision_modes_worker, 2, timeout=120)


def test_decision_longer_than_the_collective_timeout_keeps_the_job_alive(modes):
    r0, r1 = modes[0]["slow"], modes[1]["slow"]
    assert r0["result"] == r1["result"] == {"plan": "ok"}
    assert r1["decision_s"] >= 4.0 > 2.0  # longer than the collective timeout ...
    assert r1["rounds"] >= 4 and r1["interval_s"] == pytest.approx(0.1)
    assert r1["max_wait_s"] < 1.0, r1["waits"]  # ... yet no single collective waited long


def test_a_failed_decision_is_reported_on_every_rank(modes):
    for r in (modes[0]["error"], modes[1]["error"]):
        assert "policy 'bytecomp'" in r["error"] and "no plan" in r["error"], r["error"]


def test_a_rank_that_stops_answering_is_named_with_the_policy(modes):
    err = modes[1]["hung"]["error"]
    assert err.startswith("CommunicationError: policy 'bytecomp': the plan decision failed on rank 1"), err
    assert "collective timeout 2 s" in err
