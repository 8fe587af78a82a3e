"""Hugging Face models on padded batches train in ONNX Runtime with parity against eager PyTorch.

The coverage table joins the zoo's at the end of the pytest run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

from lightning_ort import ORTModule
from tests.zoo.coverage import FULL, ZOO_PROPERTY, ZooResult, run_case, summary
from tests.zoo.features import Case
from tests.zoo.huggingface import HF_CASES

RESULTS: dict[str, ZooResult] = {}
MATRIX_PRODUCTS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::baddbmm", "aten::linear"}


def _result(case: Case) -> ZooResult:
    if case.name not in RESULTS:
        RESULTS[case.name] = run_case(case)
    return RESULTS[case.name]


@pytest.mark.parametrize("case", HF_CASES, ids=[c.name for c in HF_CASES])
def test_padded_batch_trains_like_eager(case: Case, record_property: Callable[[str, Any], None]) -> None:
    result = _result(case)
    record_property(ZOO_PROPERTY, dataclasses.asdict(result))
    assert result.correct, f"{case.name}: output error {result.output_error:.2e}, grad error {result.grad_error:.2e}"


def test_huggingface_coverage() -> None:
    results = [_result(case) for case in HF_CASES]
    assert len(results) >= 12
    assert all(r.correct for r in results), summary(results)
    assert sum(r.runs_in == FULL for r in results) >= 0.9 * len(results), summary(results)


@pytest.mark.parametrize("name", ["hf_llama", "hf_bert"])
def test_profiled_step_runs_no_matrix_product_in_pytorch(name: str) -> None:
    case = next(c for c in HF_CASES if c.name == name)
    model = ORTModule(case.make_model().train())
    _, kwargs = case.make_inputs(torch.Generator().manual_seed(1))
    for _ in range(2):  # the first call sets config.problem_type on some models: TorchDynamo recompiles once
        model(**kwargs).loss.backward()
    before = model.statistics
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        model(**kwargs).loss.backward()
    after = model.statistics
    assert after.forward_runs > before.forward_runs and after.backward_runs > before.backward_runs
    assert after.cache_misses == before.cache_misses
    ran = {event.name for event in profile.events()}
    assert not ran & MATRIX_PRODUCTS, sorted(ran & MATRIX_PRODUCTS)


def test_generate_on_the_wrapper_runs_the_trained_model_in_pytorch() -> None:
    """``generate`` looks its decoding methods up on ``type(self)`` and calls the model once per new token: it
    stays the wrapped model's, and a model trained through ONNX Runtime generates what eager generates."""
    case = next(c for c in HF_CASES if c.name == "hf_gpt2")
    torch.manual_seed(0)
    wrapped = ORTModule(case.make_model().train())
    _, kwargs = case.make_inputs(torch.Generator().manual_seed(1))
    wrapped(**kwargs).loss.backward()
    runs = (wrapped.statistics.forward_runs, wrapped.statistics.backward_runs)
    wrapped.eval()
    prompt = kwargs["input_ids"][:, :4]
    settings = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
    generated = wrapped.generate(prompt, attention_mask=torch.ones_like(prompt), **settings)
    expected = wrapped.module.generate(prompt, attention_mask=torch.ones_like(prompt), **settings)
    assert torch.equal(generated, expected) and generated.shape == (prompt.shape[0], 9)
    assert (wrapped.statistics.forward_runs, wrapped.statistics.backward_runs) == runs
