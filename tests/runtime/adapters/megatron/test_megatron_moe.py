"""Mixture-of-experts through Megatron-core under runtime CP equals the one-process oracle.

What equivalence means (``runtime.adapters.megatron.binding.moe``): the step's load-balancing
term is ``coeff * sum_layers sum_units (|U| / N) LB(U)`` over units U of real tokens, N the step's
loss tokens. ``seq_aux_loss`` (a unit per sequence) and ``global_aux_loss`` (the whole step) do not
depend on the packing, so the distributed runs equal the oracle that runs every segment alone;
``aux_loss`` balances each microbatch's CP group, so its oracle groups the segments as the plan
packs them. Compared every step (fp32, relative 1e-5): the LM loss, the load-balancing term,
every layer's tokens per expert (real tokens only: padding counts nowhere) and the optimizer's
gradient norm; every parameter's reduced gradient at step 0 and the final parameters.

Each world trains all its configs in one launch and each oracle runs them in one process (the
start-up costs more than the tiny models), so the parametrised tests share module fixtures.
"""

from __future__ import annotations

from typing import Any

import pytest

from runtime.train.megatron_options import MegatronOptions
from tests.runtime.adapters.megatron.harness import (
    TOL,
    cfg,
    check_run,
    pool2,
    pool4,
    train_and_oracle,
)

pytestmark = pytest.mark.dist

KINDS = ("aux_loss", "seq_aux_loss", "global_aux_loss")


def moe(kind: str, **kw: Any) -> MegatronOptions:
    # A coefficient large enough that the term moves the gradients well past the tolerance.
    return MegatronOptions(num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.5,
                           moe_router_load_balancing_type=kind, **kw)


@pytest.fixture(scope="module")
def dp2_cp2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    p, data = pool4(tmp_path_factory.mktemp("moe-dp2-cp2"))
    options = {"aux_loss": moe("aux_loss"),
               # Megatron's production settings on one of them.
               "seq_aux_loss": moe("seq_aux_loss", use_distributed_optimizer=True,
                                   overlap_grad_reduce=True, overlap_param_gather=True,
                                   ddp_bucket_size=3000),
               "global_aux_loss": moe("global_aux_loss")}
    runs, refs = train_and_oracle([cfg(p, data, megatron=options[k]) for k in KINDS], 4)
    return {k: (run, ref) for k, run, ref in zip(KINDS, runs, refs, strict=True)}


@pytest.mark.parametrize("kind", KINDS)
def test_dp2_cp2_with_cp_1_2_4_equals_the_oracle(dp2_cp2: dict[str, Any], kind: str) -> None:
    ranks, ref = dp2_cp2[kind]
    check_run(ranks, ref)
    assert ranks[0]["summary"]["moe_load_balancing"] == kind


def test_the_load_balancing_units_matter(dp2_cp2: dict[str, Any]) -> None:
    # The three definitions give terms far apart compared with the tolerance, so each check
    # above tells its unit from the others (Megatron's own seq_aux_loss on a THD buffer is the
    # packed buffer's aux_loss).
    first = {k: dp2_cp2[k][1].logs[0].moe_aux_loss for k in KINDS}
    for a in KINDS:
        for b in KINDS:
            if a < b:
                assert abs(first[a] - first[b]) > 100 * TOL * abs(first[b]), first
    # Routing is the same function of the weights under every type at step 0.
    counts = {k: dp2_cp2[k][1].logs[0].moe_tokens_per_expert for k in KINDS}
    assert counts["aux_loss"] == counts["seq_aux_loss"] == counts["global_aux_loss"]
    tokens = dp2_cp2["aux_loss"][1].logs[0].tokens
    assert all(sum(layer) == 2 * tokens for layer in counts["aux_loss"])  # top-2, real only


@pytest.fixture(scope="module")
def tp2_sp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    p, data = pool2(tmp_path_factory.mktemp("moe-tp2-sp"), dp=1, cp=2, tp=2,
                    sequence_parallel=True)
    kinds = ("seq_aux_loss", "global_aux_loss")
    runs, refs = train_and_oracle([cfg(p, data, megatron=moe(k)) for k in kinds], 4)
    return {k: (run, ref) for k, run, ref in zip(kinds, runs, refs, strict=True)}


@pytest.mark.parametrize("kind", ["seq_aux_loss", "global_aux_loss"])
def test_tp2_sequence_parallel_equals_the_oracle(tp2_sp: dict[str, Any], kind: str) -> None:
    # Experts split over TP as the dense layers are; per-sequence counts reduced over the
    # group's TP x CP ranks, the router's gradient all-reduced over TP (sequence parallel).
    ranks, ref = tp2_sp[kind]
    check_run(ranks, ref)
