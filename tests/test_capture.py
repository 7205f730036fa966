"""The capture engine: byte accounting, parameter exclusion, dedup, layouts, safety."""

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from lightning_act import ActivationCapture, CompressionConfig, compress_activations
from lightning_act.capture import OUTSIDE_MODULES
from lightning_act.capture.records import storage_region
from lightning_act.codecs.quant import QuantizedTensor
from lightning_act.policy import FixedBits
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

G = 256


def quant_bytes(numel: int, bits: int, group_size: int = G) -> int:
    groups = -(-numel // group_size)
    return groups * group_size * bits // 8 + groups * 4


def grads_of(model, loss_fn):
    model.zero_grad()
    loss_fn().backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


class MLP(nn.Module):
    def __init__(self, width=512):
        super().__init__()
        self.fc1 = nn.Linear(64, width)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(width, 10)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def test_exact_byte_accounting_and_attribution():
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(32, 64)
    with compress_activations(model, inputs=x, bits=2) as capture:
        loss = model(x).square().mean()
    report = capture.report
    hidden = 32 * 512
    # fc1 saves x (the input batch: alive anyway, uncounted) and its weight (a parameter).
    # ReLU saves its output, which fc2 saves again: one storage, one compressed copy.
    assert report.counts["compressed"] == 1
    assert report.counts["deduplicated"] == 1
    assert report.counts["external"] == 1
    assert report.modules["act"].saved_bytes == hidden * 4
    assert report.modules["act"].stored_bytes == quant_bytes(hidden, 2)
    assert report.modules["fc2"].stored_bytes == 0
    # the MSE saves fc2's output (320 values, below min_numel): kept and counted as is
    assert report.modules[OUTSIDE_MODULES].saved_bytes == report.modules[OUTSIDE_MODULES].stored_bytes == 32 * 10 * 4
    assert report.saved_bytes == hidden * 4 + 320 * 4
    assert report.stored_bytes == quant_bytes(hidden, 2) + 320 * 4
    loss.backward()


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_stored_bytes_match_allocations(bits):
    x = torch.randn(3, 1000, requires_grad=True)
    with compress_activations(inputs=None, bits=bits) as capture:
        # mul saves x * 2, a fresh 3000-value tensor it reads linearly, and a parameter
        y = (x * 2) * nn.Parameter(torch.randn(1000))
    assert capture.report.stored_bytes == quant_bytes(3000, bits)
    y.sum().backward()


def test_parameters_and_their_views_are_never_compressed():
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(32, 64)
    reference = grads_of(model, lambda: model(x).square().mean())
    with compress_activations(model, inputs=x, bits=8) as capture:
        loss = model(x).square().mean()
    # fc2 saves fc2.weight.t() for its input gradient; fc1 needs none (x needs no grad)
    assert capture.report.counts["parameter"] == 1
    model.zero_grad()
    loss.backward()
    got = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert rel_err(got, reference) < 1e-2


def test_autocast_weight_copies_are_recast_exactly_not_stored():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256))
    x = torch.randn(64, 256)

    def loss_fn():
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            return model(x).float().square().mean()

    # min_numel above every activation: only the weight copies are handled, and exactly.
    reference = grads_of(model, loss_fn)
    with compress_activations(model, inputs=x, bits=2, min_numel=10**9) as capture:
        loss = loss_fn()
    # the second Linear saves its weight copy for the input gradient; the first needs none
    assert capture.report.counts["recast"] == 1
    weight_copies = 256 * 256 * 2
    activations = capture.report.saved_bytes - weight_copies
    assert capture.report.stored_bytes == activations
    model.zero_grad()
    loss.backward()
    got = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert torch.equal(got, reference)


def test_recast_refuses_a_weight_changed_in_place():
    model = nn.Linear(128, 128)
    x = torch.randn(16, 128, requires_grad=True)  # its gradient needs the weight copy
    with compress_activations(model, inputs=x, bits=2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().sum()
    with torch.no_grad():
        model.weight.mul_(2)
    with pytest.raises(RuntimeError, match="modified in place"):
        loss.backward()


def test_compression_happens_at_pack_time_so_in_place_changes_are_harmless():
    torch.manual_seed(0)
    w = torch.randn(4096, requires_grad=True)

    def run(modify):
        h = w * 3
        y = h.sin()  # saves h
        if modify:
            with torch.no_grad():
                h.add_(100.0)  # without hooks autograd would refuse; with them it must not matter
        return y

    capture = ActivationCapture(CompressionConfig(bits=2))
    grads = []
    for modify in (False, True):
        with capture.capturing(seed=7):  # the same rounding noise for both runs
            y = run(modify)
        grads.append(torch.autograd.grad(y.sum(), w)[0])
    assert torch.equal(grads[0], grads[1])


def test_inplace_relu_versions_are_not_confused():
    """One storage saved at two versions is stored twice; the same version once."""
    torch.manual_seed(0)
    w = (0.3 * torch.randn(8192)).requires_grad_()

    def run(inplace):
        e = (w * 2).exp()  # exp saves its output e (version 0)
        r = e.sub_(1.5).relu_() if inplace else torch.relu(e - 1.5)  # relu saves e again (version 2)
        return r.pow(2).sum()  # pow saves the same version as relu: stored once

    (g_ref,) = torch.autograd.grad(run(inplace=False), w)
    with compress_activations(bits=8) as capture:
        loss = run(inplace=True)
    (g,) = torch.autograd.grad(loss, w)
    assert capture.report.counts == {"compressed": 2, "deduplicated": 1}
    assert rel_err(g, g_ref) < 1e-2


@pytest.mark.parametrize("permuted_first", [True, False])
def test_views_of_one_storage_run_are_stored_once(permuted_first):
    """Attention's output as SDPA saves it, (B, H, T, D) over (B, T, H, D) memory, and the
    output projection's input, (B, T, C), are one run of storage: one stored copy serves both,
    whichever is saved first."""
    torch.manual_seed(0)
    w = torch.randn(30, 7, requires_grad=True)
    x = torch.randn(4, 8, 6, 5, requires_grad=True)

    def run():
        y = x * 1.5  # (B, T, H, D), contiguous
        head_major = y.transpose(1, 2)  # (B, H, T, D): a permuted view
        token_major = y.flatten(2)  # (B, T, C): a reshaped view
        # each view's gradient depends on what is restored for it: x's on head_major, w's on token_major
        if permuted_first:
            return head_major.square().sum() + (token_major @ w).sum()
        return (token_major @ w).sum() + head_major.square().sum()

    exact = torch.autograd.grad(run(), (x, w))
    with compress_activations(bits=8, min_numel=0) as capture:
        loss = run()
    # square's and matmul's inputs stored once; w (not a parameter here) stored too
    assert capture.report.counts == {"compressed": 2, "deduplicated": 1}
    grads = torch.autograd.grad(loss, (x, w))
    for g, g_ref in zip(grads, exact):
        assert rel_err(g, g_ref) < 0.05  # 8-bit noise; misplaced elements give about 1


@pytest.mark.parametrize("policy", [FixedBits(2), FixedBits(2, {"proj": "exact"}), FixedBits(8)])
def test_probes_see_the_slots_training_stores(policy):
    """Sensitivities are measured per slot, so probes must share copies as training does,
    whatever bits the policy gives the first view."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"qkv": nn.Linear(32, 96), "proj": nn.Linear(32, 32)})
    x = torch.randn(2, 16, 32)

    def loss():
        q, k, v = (t.unflatten(-1, (4, 8)).transpose(1, 2) for t in model["qkv"](x).chunk(3, dim=-1))
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, T, H, D) memory
        return model["proj"](out.transpose(1, 2).flatten(2)).square().mean()

    capture = ActivationCapture(CompressionConfig(min_numel=0), model, policy)
    with capture.capturing(inputs=x):
        loss().backward()
    stored = set(capture.report.slots)
    with capture.probing(inputs=x) as probe:
        loss().backward()
    # A slot whose bits a rule pins is stored but never probed: no allocation reads it.
    assert set(probe.slots) == {slot for slot in stored if not policy.pins_bits(capture.slots[slot])}
    if policy.rules.rules:
        assert len(probe.slots) < len(stored)


def test_storage_region_of_views():
    base = torch.randn(2, 3, 4, 5)
    whole = (0, base.numel())
    assert storage_region(base) == whole
    assert storage_region(base.transpose(1, 2)) == whole
    assert storage_region(base.permute(3, 0, 2, 1)) == whole
    assert storage_region(base.flatten(1)) == whole
    assert storage_region(base.unsqueeze(2)) == whole  # size-1 dimensions: any stride
    assert storage_region(base[1]) == (60, 60)  # a leading slice is a run too
    assert storage_region(base[:, 1]) is None  # gaps between the rows
    assert storage_region(base[..., :4]) is None
    assert storage_region(base[:1].expand(2, 3, 4, 5)) is None  # repeated elements
    assert storage_region(base[0, 0, 0, 0]) == (0, 1)


def test_a_shared_storage_run_is_stored_again_for_an_op_that_needs_more_bits():
    """A 2-bit copy made for a linear layer cannot serve as attention's query (8-bit floor)."""
    torch.manual_seed(0)
    proj = nn.Linear(64, 64)
    x = torch.randn(4, 32, 64, requires_grad=True)

    def run():
        h = x.sin()  # (B, T, C)
        projected = proj(h)  # saves h first, at 2 bits
        q = h.unflatten(-1, (4, 16)).transpose(1, 2)  # the same run, as (B, H, T, D)
        out = nn.functional.scaled_dot_product_attention(q, q * 1.0, q * 1.0)
        return projected.sum() + out.sum()

    capture = ActivationCapture(CompressionConfig(bits=2, min_numel=0), proj, FixedBits(2))
    with capture.capturing(inputs=x):
        run()
    slots = capture.report.slots.values()
    # the linear's input, the value, and the query and key at their floor (the attention's
    # output is computed again in backward, nothing stored)
    assert sorted(slot.bits for slot in slots if slot.op in ("linear", "scaled_dot_product_attention")) == [2, 2, 8, 8]
    assert capture.report.counts.get("deduplicated", 0) == 0


class WrittenOutRMSNorm(nn.Module):
    """RMSNorm as HF's Llama, Mistral and T5 write it: pointwise ops, no ``rms_norm`` call."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)  # pow saves x first
        return self.weight * (x * torch.rsqrt(variance + 1e-6))  # mul saves x again


def test_the_same_view_is_stored_again_for_a_later_save_that_needs_more_bits():
    """pow saves RMSNorm's input at the quantizer's bits; mul, which scales it by a factor
    computed from it, needs four: it stores its own copy, grouped within each 96-value row,
    and pow's 2-bit copy is freed for it (one copy, read alike by both)."""
    torch.manual_seed(0)
    norm = WrittenOutRMSNorm(96)
    x = torch.randn(4, 16, 96, requires_grad=True)
    capture = ActivationCapture(CompressionConfig(bits=2, min_numel=0), norm, FixedBits(2))
    with capture.capturing(inputs=x):
        y = norm(x * 1.0)
        slots = {(slot.op, slot.bits): slot for slot in capture.report.slots.values() if slot.shape == (4, 16, 96)}
        # x for pow at 2 bits, served by mul's copy at 4; the normalised x, which the weight scales, at 2.
        assert sorted(slots) == [("mul", 2), ("mul", 4), ("pow", 2)]
        assert (slots["pow", 2].codec, slots["pow", 2].stored_bytes) == ("shared", 0)
        assert capture.report.stored_bytes == sum(m.stored_bytes for m in capture.report.modules.values())
        y.sum().backward()
    # Shared: the factor, which rsqrt saves (exact: backward cubes it) and then mul; and x.
    assert capture.report.counts["deduplicated"] == 2 and capture.report.counts["compressed"] == 2


def test_a_written_out_rms_norm_gets_an_unbiased_gradient_at_two_bits():
    """With one shared 2-bit copy, backward multiplies x's rounding noise by itself (the
    factor's gradient sum(g x) flows back through x**2): the mean over seeds stays away from
    the exact gradient. With mul's copy at four bits, read by pow too, the bias is of the
    order of the 4-bit variance, 25 times smaller, and the mean of 16 seeds comes about
    sqrt(16) = 4 times closer than one."""
    torch.manual_seed(0)
    norm = WrittenOutRMSNorm(96)
    x = (torch.randn(8, 32, 96) * torch.rand(8, 32, 1) * 3).requires_grad_(True)
    grad_out = torch.randn(8, 32, 96)
    (exact,) = torch.autograd.grad(norm(x * 1.0), x, grad_out)
    capture = ActivationCapture(CompressionConfig(bits=2, min_numel=0), norm, FixedBits(2))
    grads = []
    for seed in range(16):
        with capture.capturing(inputs=x, seed=seed):
            y = norm(x * 1.0)
        grads.append(torch.autograd.grad(y, x, grad_out)[0])
    one = (grads[0] - exact).norm() / exact.norm()
    mean = (torch.stack(grads).mean(0) - exact).norm() / exact.norm()
    assert one > 1e-3  # compressed at all
    assert one / mean > 3.0


@pytest.mark.parametrize("rule", [None, 8, "exact"])
def test_a_shared_storage_run_is_stored_again_for_a_module_pinned_to_more_bits(rule):
    class Square(nn.Module):
        def forward(self, x):
            return x.pow(2)  # saves x as given, read linearly (2 x)

    model = nn.ModuleDict({"first": Square(), "pinned": Square()})
    x = torch.randn(4, 6, 30, requires_grad=True)
    capture = ActivationCapture(
        CompressionConfig(bits=2, min_numel=0), model, FixedBits(2, {} if rule is None else {"pinned": rule})
    )
    with capture.capturing(inputs=x):
        y = x * 2.0
        model["first"](y.transpose(1, 2))  # stored at 2 bits
        model["pinned"](y)  # the same run of storage
    bits = {slot.module: slot.bits for slot in capture.report.slots.values()}
    if rule is None:
        assert bits == {"first": 2} and capture.report.counts["deduplicated"] == 1
    else:
        assert bits == {"first": 2, "pinned": None if rule == "exact" else 8}
        assert capture.report.counts.get("deduplicated", 0) == 0


@pytest.mark.parametrize("dim", [-1, 0], ids=["strided_half", "contiguous_run"])
def test_an_exact_slot_viewing_part_of_a_storage_keeps_its_own_values_not_the_storage(dim):
    """A gate's half of a projection's output (an attention's value, a third of ``qkv``):
    kept exact as a view, it held the whole projection alive; kept as a copy, its own bytes,
    and the same gradient. A half that is a run of the storage (``qkv`` split along its
    first axis, as ``nn.MultiheadAttention`` splits it) is already dense in memory order, so
    it is copied too: kept as that run, it held the projection."""

    class Gate(nn.Module):
        def forward(self, x, scale, weight):
            projection = F.linear(x, weight)
            if dim == 0:
                projection = projection.t().contiguous().t()  # each half a run of memory
            self.projection = StorageWeakRef(projection.untyped_storage())
            kept, other = projection.chunk(2, dim=-1)
            return (kept * scale).sum() + other.sum()

    torch.manual_seed(0)
    model = Gate()
    x, scale = torch.randn(64, 32), torch.randn(64, 256, requires_grad=True)
    weight = torch.randn(512, 32, requires_grad=True)
    exact_grads = torch.autograd.grad(model(x, scale, weight), (scale, weight))
    capture = ActivationCapture(CompressionConfig(bits=2, min_numel=0), model, FixedBits(2, {"op:mul": "exact"}))
    with capture.capturing(inputs=(x, scale)):
        loss = model(x, scale, weight)
    gc.collect()
    assert model.projection.expired()  # what the process keeps, not only what the report counts
    assert capture.report.stored_bytes == 64 * 256 * 4  # the half, not the projection's 64 x 512
    for grad, exact in zip(torch.autograd.grad(loss, (scale, weight)), exact_grads):
        assert torch.equal(grad, exact)


def test_dedup_is_not_fooled_by_a_reused_address():
    """Freed storage handed to a new tensor of the same shape must not hit the cache."""
    torch.manual_seed(0)
    w = torch.randn(16384, requires_grad=True)
    scales = [0.5, -0.3, 0.2, 0.4]

    def run():
        total = 0
        for s in scales:
            h = w * s
            total = total + h.sin().sum()  # sin saves h; h dies after compression
            del h
        return total

    (g_ref,) = torch.autograd.grad(run(), w)
    with compress_activations(bits=8) as capture:
        loss = run()
    (g,) = torch.autograd.grad(loss, w)
    assert capture.report.counts.get("deduplicated", 0) == 0
    assert rel_err(g, g_ref) < 1e-2


def test_retain_graph_and_double_backward():
    torch.manual_seed(0)
    x = (0.5 * torch.randn(64, 128)).requires_grad_()

    def run():
        return (x * 1.5).tanh().pow(2).sum()

    (g_ref,) = torch.autograd.grad(run(), x, create_graph=True)
    (gg_ref,) = torch.autograd.grad(g_ref.sum(), x)
    with compress_activations(bits=8):
        loss = run()
    g1 = torch.autograd.grad(loss, x, retain_graph=True)[0]
    (g2,) = torch.autograd.grad(loss, x, create_graph=True)
    assert torch.equal(g1, g2)  # decoding twice gives the same tensor
    (gg,) = torch.autograd.grad(g2.sum(), x)
    assert rel_err(g2, g_ref) < 1e-2
    assert rel_err(gg, gg_ref) < 2e-2


def test_layouts_are_restored():
    torch.manual_seed(0)
    cl = torch.randn(4, 16, 8, 8).to(memory_format=torch.channels_last).requires_grad_()
    base = torch.randn(1, 64, 1, requires_grad=True)

    with compress_activations(bits=8) as capture:
        a = (cl * 1.0).sin()  # channels_last saved tensor
        b = (base * 1.0).expand(32, 64, 16).cos()  # expanded: stride 0
    unpacked_a = a.grad_fn._saved_self  # runs the unpack hook
    unpacked_b = b.grad_fn._saved_self
    assert unpacked_a.stride() == cl.stride()
    assert unpacked_b.stride() == (0, 1, 0)
    assert unpacked_b.shape == (32, 64, 16)
    # the expanded tensor is stored once: 64 values, below min_numel, so kept as is
    assert capture.report.counts["compressed"] == 1


def test_partial_views_are_compressed():
    torch.manual_seed(0)
    w = torch.randn(32, 3 * 1024, requires_grad=True)
    with compress_activations(bits=4) as capture:
        qkv = w * 1.0
        q, k, v = qkv.split(1024, dim=1)
        out = (q.pow(2) + k.pow(2) + v.pow(2)).sum()  # each saves its input slice
    assert capture.report.counts["compressed"] == 3
    # one storage, counted once on the saved side; three compressed slices
    assert capture.report.saved_bytes == 32 * 3 * 1024 * 4
    assert capture.report.stored_bytes == 3 * quant_bytes(32 * 1024, 4)
    out.backward()


def test_pausing_for_backward_leaves_the_records_to_autograd():
    # Backward frees each record after the node that reads it only if the capture holds none.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.Tanh())
    capture = ActivationCapture(CompressionConfig(bits=2), model)
    x = torch.randn(64, 256)
    with capture.capturing(inputs=x):
        loss = model(x).sum()
        capture.pause()
        # type(), not isinstance(): a dead weak proxy among the objects raises on isinstance.
        stored = [weakref.ref(r.codes) for r in gc.get_objects() if type(r) is QuantizedTensor]
        assert stored
        del loss
        gc.collect()
        assert all(ref() is None for ref in stored)
        capture.resume()
    capture.close()


def test_nonfinite_groups_are_counted_across_pauses():
    x = torch.randn(4096, requires_grad=True)
    capture = ActivationCapture(CompressionConfig(bits=2))
    with capture.capturing():
        h = x * 1.0
        with torch.no_grad():
            h[300] = float("inf")
        y = h.sin().sum()
        capture.pause()
        capture.resume()
        z = (h * 2.0).cos().sum()
    assert int(capture.report.nonfinite_groups) == 2
    (y + z).backward()


def test_nonfinite_activations_are_counted_and_decode_to_nan():
    x = torch.randn(4096, requires_grad=True)
    with compress_activations(bits=2) as capture:
        h = x * 1.0
        with torch.no_grad():
            h[300] = float("inf")
        y = h.sin().sum()
    assert int(capture.report.nonfinite_groups) == 1
    y.backward()
    nan = torch.isnan(x.grad)
    assert nan[256:512].all() and not nan[:256].any() and not nan[512:].any()


def test_hooks_are_popped_on_exception():
    model = MLP()
    x = torch.randn(8, 64)
    capture = ActivationCapture(CompressionConfig(bits=2, min_numel=1), model)
    with pytest.raises(ZeroDivisionError):
        with capture.capturing(inputs=x):
            model(x)
            raise ZeroDivisionError
    assert not capture.active
    reference = grads_of(model, lambda: model(x).sum())
    again = grads_of(model, lambda: model(x).sum())  # a plain step afterwards is untouched
    assert torch.equal(reference, again)


def test_global_random_stream_is_untouched():
    x = torch.randn(64, 512, requires_grad=True)
    torch.manual_seed(123)
    with compress_activations(bits=2):
        (x * 2).sin().sum()
    after_compression = torch.rand(4)
    torch.manual_seed(123)
    assert torch.equal(after_compression, torch.rand(4))


def test_bf16_activations():
    torch.manual_seed(0)
    x = torch.randn(64, 512, dtype=torch.bfloat16, requires_grad=True)
    (g_ref,) = torch.autograd.grad((x * 2).sin().float().sum(), x)
    with compress_activations(bits=8) as capture:
        y = (x * 2).sin().float().sum()
    (g,) = torch.autograd.grad(y, x)
    assert g.dtype == torch.bfloat16
    assert capture.report.stored_bytes == quant_bytes(64 * 512, 8)
    assert rel_err(g.float(), g_ref.float()) < 2e-2


def test_reentrant_recompute_inside_backward_passes_through():
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(16, 64, requires_grad=True)  # reentrant checkpointing needs a grad input
    reference = grads_of(model, lambda: model(x).sum())
    with compress_activations(model, inputs=x, bits=8):
        loss = checkpoint(model, x, use_reentrant=True).sum()
        model.zero_grad()
        loss.backward()  # recompute happens inside backward, while the hooks are installed
    got = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert torch.allclose(got, reference, rtol=1e-5, atol=1e-6)


def test_keyword_and_config_are_exclusive():
    with pytest.raises(ValueError, match="either config or keyword"):
        compress_activations(config=CompressionConfig(), bits=2)
    with pytest.raises(ValueError, match="bits=3"):
        CompressionConfig(bits=3)
    with pytest.raises(ValueError, match="group_size=100"):
        CompressionConfig(group_size=100)


def test_masks_and_indices_are_stored_losslessly():
    torch.manual_seed(0)
    x = torch.randn(8, 16, 32, 32, requires_grad=True)
    with compress_activations(bits=2, min_numel=1024) as capture:
        pooled = nn.functional.max_pool2d(x * 1.0, 2)  # saves its input and int64 indices
        out = nn.functional.dropout(pooled, 0.5, training=True).sum()  # saves a mask
    decisions = capture.report.counts
    assert decisions["lossless"] >= 1
    (g,) = torch.autograd.grad(out, x)
    # with exact indices the gradient lands on exactly one element per 2x2 window
    nonzero = (g != 0).view(8, 16, 16, 2, 16, 2).sum(dim=(3, 5))
    assert nonzero.max() <= 1


@pytest.mark.parametrize("codec", ["division", "pool"])
def test_other_codecs_train_through_the_capture(codec):
    torch.manual_seed(0)
    conv = nn.Conv2d(8, 8, 3, padding=1)
    x = torch.randn(4, 8, 32, 32)
    with compress_activations(conv, inputs=x, bits=2, codec=codec) as capture:
        loss = conv(torch.tanh(conv(x))).square().mean()
    loss.backward()
    assert capture.report.counts["compressed"] >= 1
    assert capture.report.ratio > 3.0
    assert all(torch.isfinite(p.grad).all() for p in conv.parameters())


def test_reduction_statistics_are_kept_exact():
    """LayerNorm's mean and rstd scale the whole backward: exact. Attention's logsumexp is
    computed again in backward, with its output, from the stored query, key and value."""
    torch.manual_seed(0)
    norm = nn.LayerNorm(64)
    x = torch.randn(8, 4, 128, 64, requires_grad=True)
    with compress_activations(norm, bits=2, min_numel=0) as capture:
        h = norm(x)
        out = nn.functional.scaled_dot_product_attention(h, h * 1.0, h * 1.0, is_causal=True)
    shapes = {tuple(slot.shape) for slot in capture.report.slots.values()}
    assert (8, 4, 128, 1) not in shapes and (8, 4, 128) not in shapes
    # mean and rstd of the norm; the attention's logsumexp and output (CPU's flash kernel saves them)
    assert capture.report.counts["statistic"] >= 2 and capture.report.counts["recomputed"] == 2
    out.sum().backward()
    assert torch.isfinite(x.grad).all()


def test_attention_query_and_key_are_stored_at_eight_bits_or_more():
    """A softmax recomputed from noisy q and k biases the gradient: they never go below 8 bits."""
    torch.manual_seed(0)
    qkv = nn.Linear(64, 3 * 64)
    x = torch.randn(4, 128, 64)

    def attention():
        q, k, v = (t.unflatten(-1, (4, 16)).transpose(1, 2) for t in qkv(x).chunk(3, dim=-1))
        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    exact = torch.autograd.grad(attention().square().sum(), qkv.weight)[0]
    for rules in ({}, {"op:scaled_dot_product_attention": 2}):
        capture = ActivationCapture(CompressionConfig(bits=2, min_numel=0), qkv, FixedBits(2, rules))
        with capture.capturing(inputs=x):
            out = attention()
        by_op = [slot for slot in capture.report.slots.values() if slot.op == "scaled_dot_product_attention"]
        # query and key at 8 bits; value at the 2 bits asked for; the output recomputed
        assert sorted(slot.bits for slot in by_op) == [2, 8, 8]
        floors = sorted(info.min_bits for info in capture.slots.values() if info.op == "scaled_dot_product_attention")
        assert floors == [1, 8, 8]
        grad = torch.autograd.grad(out.square().sum(), qkv.weight)[0]
        assert ((grad - exact).norm() / exact.norm()).item() < 0.5


@pytest.mark.parametrize("op", ["softmax", "log_softmax", "cross_entropy"])
def test_softmax_outputs_are_stored_at_eight_bits_or_more(op):
    torch.manual_seed(0)
    logits = torch.randn(64, 512, requires_grad=True)
    target = torch.randint(0, 512, (64,))
    run = {
        "softmax": lambda z: z.softmax(-1).square().sum(),
        "log_softmax": lambda z: nn.functional.log_softmax(z, -1)[:, 0].sum(),
        "cross_entropy": lambda z: nn.functional.cross_entropy(z, target),
    }[op]
    exact = torch.autograd.grad(run(logits * 1.0), logits)[0]
    with compress_activations(bits=2) as capture:
        loss = run(logits * 1.0)
    (slot,) = [slot for slot in capture.report.slots.values() if slot.op == op]
    assert slot.bits == 8
    grad = torch.autograd.grad(loss, logits)[0]
    assert ((grad - exact).norm() / exact.norm()).item() < 0.05


def test_every_encoded_tensor_is_held_for_the_stream_that_reads_it(monkeypatch):
    """The encode path marks each tensor it drops for the current stream (a no-op on the CPU)."""
    from lightning_act.capture import store

    held = []
    monkeypatch.setattr(store, "_hold_until_read", held.append)
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(8, 64)
    with compress_activations(model, inputs=x, bits=2) as capture:
        loss = model(x).square().mean()
    loss.backward()
    assert len(held) == capture.report.counts["compressed"] + capture.report.counts.get("lossless", 0) >= 1
    assert all(isinstance(t, torch.Tensor) for t in held)


def test_a_save_kept_exact_is_never_served_by_an_earlier_rounded_copy():
    """ReLU stores its output rounded (zeros exact); amax saves the same tensor and its backward
    tests it for equality with the maxima: it must get the tensor itself, or nothing matches
    and the gradient is 0/0 (max aggregation in a graph network: NaN in every weight)."""
    torch.manual_seed(0)
    x = torch.randn(64, 256, requires_grad=True)
    (exact,) = torch.autograd.grad(torch.relu(x * 1.0).amax(1).sum(), x)
    with compress_activations(bits=8) as capture:
        loss = torch.relu(x * 1.0).amax(1).sum()
    (grad,) = torch.autograd.grad(loss, x)
    assert capture.report.counts.get("deduplicated", 0) == 0
    assert torch.equal(grad, exact)


@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU])
def test_unfused_recurrent_layers_are_stored_where_the_fused_kernel_is_kept_whole(cell):
    """oneDNN's LSTM saves an opaque byte workspace, kept whole; through aten's per-step ops
    (``unfused_recurrent``) its saves are floats the codecs take. The switches come back."""
    torch.manual_seed(0)
    rnn = cell(16, 32, num_layers=2, batch_first=True)
    x = torch.randn(4, 12, 16)
    params = list(rnn.parameters())
    exact = torch.cat([g.flatten() for g in torch.autograd.grad(rnn(x)[0].square().sum(), params)])

    def run(**settings):
        capture = ActivationCapture(CompressionConfig(bits=8, min_numel=1, **settings), rnn)
        with capture.capturing(inputs=x):
            loss = rnn(x)[0].square().sum()
        noisy = torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)])
        return capture.report, ((noisy - exact).norm() / exact.norm()).item()

    fused, _ = run()
    unfused, error = run(unfused_recurrent=True)
    assert torch._C._get_mkldnn_enabled() and torch._C._get_cudnn_enabled()
    assert error < 0.02
    if cell is nn.LSTM:  # GRU has no oneDNN kernel on the CPU: one path either way
        assert unfused.stored_bytes * 3 < fused.stored_bytes, (unfused.stored_bytes, fused.stored_bytes)
