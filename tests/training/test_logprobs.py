import pytest
import torch

from grpod.training.logprobs import token_entropy, token_logprobs


def reference_logprobs(logits, targets, temps):
    return torch.log_softmax(logits.double() / temps.double()[:, None], dim=-1).gather(1, targets[:, None]).squeeze(1)


def make_inputs(n=11, vocab=37, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, vocab, generator=gen) * 3).to(dtype)
    targets = torch.randint(0, vocab, (n,), generator=gen)
    temps = torch.rand(n, generator=gen) + 0.5
    return logits, targets, temps


@pytest.mark.parametrize("chunk", [1, 3, 7, 11, 1000])
def test_chunked_values_and_gradients_equal_unchunked(chunk):
    logits, targets, temps = make_inputs()
    logits.requires_grad_(True)
    got = token_logprobs(logits, targets, temps, chunk_tokens=chunk)
    upstream = torch.linspace(-1, 2, logits.shape[0])
    (grad,) = torch.autograd.grad((got * upstream).sum(), logits)

    ref_logits = logits.detach().clone().requires_grad_(True)
    want = torch.log_softmax(ref_logits / temps[:, None], dim=-1).gather(1, targets[:, None]).squeeze(1)
    (ref_grad,) = torch.autograd.grad((want * upstream).sum(), ref_logits)

    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-6)


def test_chunk_size_does_not_change_the_result():
    logits, targets, temps = make_inputs(n=50)
    results = [token_logprobs(logits, targets, temps, chunk_tokens=c) for c in (1, 7, 50)]
    for other in results[1:]:
        torch.testing.assert_close(other, results[0], rtol=1e-7, atol=0)


def test_gradcheck_in_double():
    logits, targets, temps = make_inputs(n=5, vocab=7)
    logits = logits.double().requires_grad_(True)
    # The function computes in fp32 internally; check against finite differences at fp32 tolerance.
    assert torch.autograd.gradcheck(
        lambda x: token_logprobs(x, targets, temps, chunk_tokens=2).double(), (logits,), eps=1e-3, atol=2e-3
    )


def test_bf16_logits_give_fp32_logprobs_of_the_bf16_values_and_bf16_gradient():
    logits, targets, temps = make_inputs(dtype=torch.bfloat16)
    logits.requires_grad_(True)
    got = token_logprobs(logits, targets, temps, chunk_tokens=4)
    want = reference_logprobs(logits.detach().float(), targets, temps).float()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    got.sum().backward()
    assert logits.grad.dtype == torch.bfloat16


def test_backward_saves_no_fp32_copy_of_the_logits():
    logits, targets, temps = make_inputs(n=64, vocab=50, dtype=torch.bfloat16)
    logits.requires_grad_(True)
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_logprobs(logits, targets, temps, chunk_tokens=8)
    full_size = [s for s in saved if s[0] == (64, 50)]
    assert full_size == [((64, 50), torch.bfloat16)], saved


def test_temperature_divides_the_logits():
    logits, targets, _ = make_inputs()
    got = token_logprobs(logits, targets, 2.0, chunk_tokens=4)
    want = torch.log_softmax(logits / 2.0, dim=-1).gather(1, targets[:, None]).squeeze(1)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("temperature", [0.0, -1.0, torch.tensor([1.0, 0.0, 1.0])])
def test_non_positive_temperature_is_refused(temperature):
    logits, targets, _ = make_inputs(n=3)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        token_logprobs(logits, targets, temperature)


def test_wrong_temperature_count_is_refused():
    logits, targets, _ = make_inputs(n=3)
    with pytest.raises(ValueError, match="2 entries for 3 tokens"):
        token_logprobs(logits, targets, torch.tensor([1.0, 1.0]))


@pytest.mark.parametrize("chunk", [1, 4, 100])
def test_entropy_matches_the_definition(chunk):
    logits, _, temps = make_inputs()
    logits[0, :5] = float("-inf")  # masked-out entries have p = 0 and must not produce NaN
    got = token_entropy(logits, temps, chunk_tokens=chunk)
    p = torch.softmax(logits.double() / temps.double()[:, None], dim=-1)
    want = -(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(-1)
    assert not got.requires_grad
    torch.testing.assert_close(got, want.float(), rtol=0, atol=1e-5)
