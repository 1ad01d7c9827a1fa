"""mtp-03 (VLLM_DRAFT_TOKENS_PER_REQUEST): DraftTokensHandler under PP.

Under PP=3 with async scheduling each request is decoded only every pp_size
steps, so two requests alternate batches. The engine defers sampling of a
structured-output batch and asks the worker for drafts
(take_draft_token_ids -> Scheduler.update_draft_token_ids_in_output). Upstream
returns only the last batch's drafts, so the deferred request keeps its -1
placeholders and the bonus position is unconstrained (SPEC §8).
"""

import contextlib
import types
from unittest import mock

import numpy as np
import pytest
import torch

# Import before torch.cuda is patched below.
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import DraftTokenIds
from vllm.v1.worker.gpu.model_runner import GPUModelRunner
from vllm.v1.worker.gpu.spec_decode.utils import DraftTokensHandler


class _Stream:
    def wait_stream(self, s):
        pass


class _Event:
    instances = 0

    def __init__(self, *a, **k):
        _Event.instances += 1
        self.synced = 0

    def record(self, *a):
        pass

    def synchronize(self):
        self.synced += 1


@pytest.fixture
def cpu_cuda():
    """Run the handler on CPU: the CUDA stream/event calls become no-ops."""
    with (
        mock.patch.object(torch.cuda, "Stream", lambda *a, **k: _Stream()),
        mock.patch.object(torch.cuda, "Event", _Event),
        mock.patch.object(torch.cuda, "current_stream", lambda *a, **k: _Stream()),
        mock.patch.object(torch.cuda, "stream", lambda s: contextlib.nullcontext()),
        mock.patch.object(torch.Tensor, "record_stream", lambda self, s: None),
    ):
        yield


def _batch(req_ids, structured=True):
    return types.SimpleNamespace(req_ids=list(req_ids), has_structured_output_reqs=structured)


def _fake_scheduler(req_ids):
    reqs = {r: types.SimpleNamespace(is_finished=lambda: False) for r in req_ids}
    return types.SimpleNamespace(
        requests=reqs,
        structured_output_manager=types.SimpleNamespace(
            validate_tokens=lambda req, toks: list(toks)
        ),
    )


def _deferred_output(req_id, n=2):
    return types.SimpleNamespace(
        scheduled_spec_decode_tokens={req_id: [-1] * n}, num_invalid_spec_tokens=None
    )


def _alternate_and_take(handler):
    """A's batch, then B's batch (PP alternation), then A's deferred take."""
    handler.set_draft_tokens(_batch(["a"]), torch.tensor([[11, 12]]))
    handler.set_draft_tokens(_batch(["b"]), torch.tensor([[21, 22]]))
    so = _deferred_output("a")
    Scheduler.update_draft_token_ids_in_output(
        _fake_scheduler(["a", "b"]), handler.get_draft_tokens(), so
    )
    return so


def test_upstream_bonus_draft_is_minus_one(cpu_cuda, monkeypatch):
    # Gate off = upstream: A's deferred batch keeps [-1, -1] and no
    # num_invalid_spec_tokens entry -> unconstrained bonus-position mask.
    monkeypatch.setenv("VLLM_DRAFT_TOKENS_PER_REQUEST", "0")
    h = DraftTokensHandler(torch.device("cpu"))
    assert h.per_request is False
    out = _alternate_and_take(h)
    assert out.scheduled_spec_decode_tokens["a"] == [-1, -1]
    assert out.num_invalid_spec_tokens == {}
    got = h.get_draft_tokens()
    assert got.req_ids == ["b"]


def test_patched_returns_latest_drafts_of_every_request(cpu_cuda, monkeypatch):
    monkeypatch.setenv("VLLM_DRAFT_TOKENS_PER_REQUEST", "1")
    h = DraftTokensHandler(torch.device("cpu"))
    assert h.per_request is True
    out = _alternate_and_take(h)
    assert out.scheduled_spec_decode_tokens["a"] == [11, 12]
    got = h.get_draft_tokens()
    assert dict(zip(got.req_ids, got.draft_token_ids)) == {"a": [11, 12], "b": [21, 22]}
    # Not popped on get: a second deferred take (for B) still finds B.
    so_b = _deferred_output("b")
    Scheduler.update_draft_token_ids_in_output(
        _fake_scheduler(["a", "b"]), h.get_draft_tokens(), so_b
    )
    assert so_b.scheduled_spec_decode_tokens["b"] == [21, 22]


def test_patched_latest_wins_and_non_structured_is_minus_one(cpu_cuda):
    h = DraftTokensHandler(torch.device("cpu"), per_request=True)
    h.set_draft_tokens(_batch(["a", "c"]), torch.tensor([[1, 2], [3, 4]]))
    h.set_draft_tokens(_batch(["b"]), torch.tensor([[5, 6]]))
    h.set_draft_tokens(_batch(["a"]), torch.tensor([[7, 8]]))  # A's next step
    h.set_draft_tokens(_batch(["c"], structured=False), torch.tensor([[9, 9]]))
    got = h.get_draft_tokens()
    assert dict(zip(got.req_ids, got.draft_token_ids)) == {
        "a": [7, 8],
        "c": [-1, -1],
        "b": [5, 6],
    }


def test_patched_one_event_per_set_and_each_synced(cpu_cuda):
    h = DraftTokensHandler(torch.device("cpu"), per_request=True)
    h.set_draft_tokens(_batch(["a"]), torch.tensor([[1, 2]]))
    h.set_draft_tokens(_batch(["b"]), torch.tensor([[3, 4]]))
    ev_a, ev_b = h._latest["a"][2], h._latest["b"][2]
    assert ev_a is not ev_b  # the shared copy_event cannot cover two copies
    h.get_draft_tokens()
    assert ev_a.synced == 1 and ev_b.synced == 1


def test_patched_finished_requests_dropped(cpu_cuda):
    h = DraftTokensHandler(torch.device("cpu"), per_request=True)
    h.set_draft_tokens(_batch(["a", "b"]), torch.tensor([[1, 2], [3, 4]]))
    h.remove_request("a")
    h.remove_request("zzz")  # unknown ids are fine
    got = h.get_draft_tokens()
    assert got.req_ids == ["b"] and got.draft_token_ids == [[3, 4]]
    assert isinstance(got, DraftTokenIds)


def test_row_views_survive_batch_array(cpu_cuda):
    # Rows are views into the batch's host copy; later sets must not clobber.
    h = DraftTokensHandler(torch.device("cpu"), per_request=True)
    h.set_draft_tokens(_batch(["a", "b"]), torch.tensor([[1, 2], [3, 4]]))
    h.set_draft_tokens(_batch(["a"]), torch.tensor([[5, 6]]))
    assert isinstance(h._latest["b"][0], np.ndarray)
    got = h.get_draft_tokens()
    assert dict(zip(got.req_ids, got.draft_token_ids)) == {"a": [5, 6], "b": [3, 4]}


def _runner_self(handler):
    calls = []
    return types.SimpleNamespace(
        model_state=types.SimpleNamespace(remove_request=lambda r: None),
        req_states=types.SimpleNamespace(remove_request=lambda r: 0),
        pooling_runner=None,
        pp_handler=None,
        encoder_cache=None,
        prompt_logprobs_worker=None,
        lora_state=types.SimpleNamespace(remove_request=lambda r: calls.append(r)),
        draft_tokens_handler=handler,
    )


@pytest.mark.parametrize("gate", [True, False])
def test_model_runner_remove_request_drops_drafts(cpu_cuda, gate):
    h = DraftTokensHandler(torch.device("cpu"), per_request=gate)
    h.set_draft_tokens(_batch(["a", "b"]), torch.tensor([[1, 2], [3, 4]]))
    assert GPUModelRunner._remove_request(_runner_self(h), "a") is True
    got = h.get_draft_tokens()
    if gate:
        assert got.req_ids == ["b"]
    else:  # upstream: the last batch, untouched
        assert got.req_ids == ["a", "b"]
