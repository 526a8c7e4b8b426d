"""Sliding windows, attention sinks, soft-capping and the query scale on every one-device attention
path, against the definition written independently in torch (float64, autograd for the gradients)
and against transformers' own attention functions (gpt-oss's sinks, Gemma 2's soft-cap, the
sliding-window and packed-sequence mask functions of `transformers.masking_utils`).

Paths: `xla_attention` (parallel.attention_impl = xla), the hand-written kernel
(`jaxpar.kernels.attention.patterned_attention`, jaxpar_xla), its band for sliding layers
(`jaxpar.kernels.local_attention`) and the chunked flash kernel the
context-parallel implementations share (`flash_attention_local`, chunks of 4 so windows skip chunk
pairs). Windows smaller than, equal to and larger than the sequence, with packed documents and
padding. Measured worst relative errors (fp32 against float64, every path and case): outputs 2.0e-7,
gradients of q, k, v and the sinks 6.9e-7.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxpar.kernels.attention import patterned_attention
from jaxpar.kernels.local_attention import patterned_or_banded
from jaxpar.models.attention_pattern import Pattern, layer_windows, ranges, xla_attention
from jaxpar.parallel.context import flash_attention_local
from jaxpar.parallel.context.sequence import segment_positions
from tests.support.tiers import slow_except

B, T, H, K, D = 2, 24, 4, 2, 8
RTOL = 2e-5  # max |error| / max |reference|, fp32 paths against float64


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((B, T, h, D)) for h in (H, K, K))
    cotangent = rng.standard_normal((B, T, H, D))
    sinks = rng.standard_normal(H)
    # Row 0: three documents and trailing padding; row 1: two documents, no padding.
    segments = np.array([[1] * 7 + [2] * 9 + [3] * 5 + [0] * 3, [4] * 13 + [5] * 11], np.int32)
    return q, k, v, cotangent, sinks, segments


def _torch_mask(window, segments):
    """[B, 1, T, T] bool from transformers' mask functions (index based: text order)."""
    from transformers import masking_utils as mu

    b = torch.arange(B)[:, None, None, None]
    h = torch.zeros((1, 1, 1, 1), dtype=torch.long)
    qi, ki = torch.arange(T)[None, None, :, None], torch.arange(T)[None, None, None, :]
    visible = mu.causal_mask_function(b, h, qi, ki)
    if window:
        visible = visible & mu.sliding_window_causal_mask_function(window)(b, h, qi, ki)
    if segments is not None:
        visible = visible & mu.packed_sequence_mask_function(torch.as_tensor(segments))(b, h, qi, ki)
    return visible.expand(B, 1, T, T)


def _torch_reference(q, k, v, cotangent, window, sinks, softcap, scale, segments):
    """(out, {q, k, v, sinks: grads}) of sum(out · cotangent), the definition in float64."""
    q, k, v = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, k, v))
    sink = None if sinks is None else torch.tensor(sinks, dtype=torch.float64, requires_grad=True)
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))  # [B, heads, T, D]
    kh, vh = (x.repeat_interleave(H // K, dim=1) for x in (kh, vh))
    logits = qh @ kh.transpose(2, 3) * (D**-0.5 if scale is None else scale)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits.masked_fill(~_torch_mask(window, segments), -torch.inf)
    if sink is not None:
        logits = torch.cat([logits, sink.reshape(1, H, 1, 1).expand(B, H, T, 1)], dim=-1)
    probs = torch.nan_to_num(torch.softmax(logits, dim=-1))[..., :T]
    out = (probs @ vh).transpose(1, 2)
    if segments is not None:
        out = out * torch.as_tensor(segments != 0)[:, :, None, None]
    (out * torch.tensor(cotangent)).sum().backward()
    grads = {"q": q.grad, "k": k.grad, "v": v.grad} | ({} if sink is None else {"sinks": sink.grad})
    return out.detach().numpy(), {name: g.numpy() for name, g in grads.items()}


def _one_device(path):
    """attention(q, k, v, segments, window, sinks, softcap, scale) -> out, for each path."""
    if path == "xla":
        return lambda q, k, v, seg, window, sinks, cap, scale: xla_attention(q, k, v, seg, Pattern(window, sinks, cap, scale))
    if path == "jaxpar_xla":
        return patterned_attention
    if path == "banded":  # the band for windows 1 .. SPAN (a lax.cond on the traced window), else jaxpar_xla
        return lambda q, k, v, seg, window, sinks, cap, scale: patterned_or_banded(q, k, v, seg, window, SPAN, sinks, cap, scale)

    def flash(q, k, v, seg, window, sinks, cap, scale):
        pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)) if seg is None else segment_positions(seg)
        return flash_attention_local(q, k, v, pos, pos, q_seg=seg, kv_seg=seg, scale=scale, block_q=4, block_kv=4,
                                     window=window, sinks=sinks, softcap=cap)

    return flash


def _run(path, q, k, v, cotangent, window, sinks, softcap, scale, segments):
    attention = _one_device(path)

    def loss(q, k, v, sinks):
        out = attention(q, k, v, segments, window, sinks, softcap, scale)
        return jnp.sum(out * cotangent), out

    args = [jnp.asarray(x, jnp.float32) for x in (q, k, v)] + [None if sinks is None else jnp.asarray(sinks, jnp.float32)]
    segments = None if segments is None else jnp.asarray(segments)
    cotangent = jnp.asarray(cotangent, jnp.float32)
    argnums = (0, 1, 2) if sinks is None else (0, 1, 2, 3)
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))(*args)
    return np.asarray(out), dict(zip(("q", "k", "v", "sinks"), (np.asarray(g) for g in grads)))


def _relative(got, want):
    return float(np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want)))


def _assert_matches(got, want, rtol=RTOL):
    (out, grads), (ref_out, ref_grads) = got, want
    assert set(grads) == set(ref_grads)
    errors = {"out": _relative(out, ref_out)} | {name: _relative(grads[name], ref_grads[name]) for name in ref_grads}
    assert all(e < rtol for e in errors.values()), errors
    return errors


PATHS = ("xla", "jaxpar_xla", "flash", "banded")
SPAN = 6  # the banded path's static span: windows 5, 1 and 6 take the band (tiles of 2), the others the full kernel
# (window, sinks, softcap, scale, packed): windows 1, 5, 6 (< T), T and 40 (> T), 0 (full) and None.
# Window 6 with chunks of 4: a key chunk whose last key is exactly the window's first (distance 5)
# must not be skipped (a skip predicate off by one drops it).
CASES = [
    (5, True, 30.0, 0.2, True),
    (1, True, None, None, True),
    (T, False, 3.0, None, True),
    (40, True, None, None, False),
    (6, False, None, None, False),
    (0, True, 2.0, 0.5, True),
    (None, True, None, None, True),
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("window, sinks, softcap, scale, packed", slow_except(CASES, CASES[0], CASES[4]))
def test_matches_the_definition(path, window, sinks, softcap, scale, packed):
    q, k, v, ct, sink_values, segments = _inputs()
    segments = segments if packed else None
    sink_values = sink_values if sinks else None
    want = _torch_reference(q, k, v, ct, window, sink_values, softcap, scale, segments)
    _assert_matches(_run(path, q, k, v, ct, window, sink_values, softcap, scale, segments), want)


def _transformers_module(sinks):
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = H // K, False
    module.sinks = None if sinks is None else torch.nn.Parameter(torch.tensor(sinks, dtype=torch.float64))
    return module


@pytest.mark.parametrize("path", PATHS)
def test_matches_transformers_gpt_oss_and_gemma2_attention(path):
    """gpt-oss's eager attention (sinks, a 5-token window, packed documents without padding) and
    Gemma 2's (soft-cap 3, query_pre_attn_scalar 12), outputs and their q / k / v / sink gradients."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss

    q, k, v, ct, sinks, segments = _inputs(seed=3)
    segments = np.where(segments == 0, 3, segments)  # no padding: transformers gives padding rows no meaning
    for attention, window, sink_values, cap, scale in ((gpt_oss, 5, sinks, None, D**-0.5), (gemma2, 7, None, 3.0, 12**-0.5)):
        module = _transformers_module(sink_values)
        qt, kt, vt = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, k, v))
        additive = torch.zeros((B, 1, T, T), dtype=torch.float64).masked_fill(~_torch_mask(window, segments), -1e30)
        kwargs = {"softcap": cap} if cap is not None else {}
        out, _ = attention(module, qt.transpose(1, 2), kt.transpose(1, 2), vt.transpose(1, 2), additive, scaling=scale,
                           **kwargs)
        (out * torch.tensor(ct)).sum().backward()
        grads = {"q": qt.grad, "k": kt.grad, "v": vt.grad} | ({} if module.sinks is None else {"sinks": module.sinks.grad})
        want = (out.detach().numpy(), {name: g.numpy() for name, g in grads.items()})
        _assert_matches(_run(path, q, k, v, ct, window, sink_values, cap, scale, segments), want)


def test_window_is_scanned_data():
    """Layers of two kinds in one `lax.scan`: the window is a traced int32 per layer (0: full), and
    each step equals the same call with the window given as a constant."""
    q, k, v, _, sinks, segments = (jnp.asarray(x) for x in _inputs(seed=5))
    q, k, v, sinks = (x.astype(jnp.float32) for x in (q, k, v, sinks))
    windows = jnp.asarray(layer_windows(_model(4, sliding_window=3, layer_types=["sliding_attention", "full_attention"] * 2)))
    np.testing.assert_array_equal(windows, [3, 0, 3, 0])
    for path in PATHS:
        attention = _one_device(path)

        def layer(x, window, attention=attention):
            return attention(x, k, v, segments, window, sinks, None, None), None

        scanned = jax.jit(lambda x, attention=attention, layer=layer: jax.lax.scan(layer, x, windows)[0])(q)
        x = q
        for w in (3, 0, 3, 0):
            x = attention(x, k, v, segments, w, sinks, None, None)
        np.testing.assert_allclose(scanned, x, rtol=1e-6, atol=1e-6, err_msg=path)


def _model(layers, **keys):
    from ml_collections import ConfigDict

    from jaxpar.models.attention_pattern import option_keys

    model = ConfigDict(dict(num_hidden_layers=layers, **option_keys()))
    model.update(keys)
    return model


def test_layer_windows_and_ranges():
    assert list(layer_windows(_model(3))) == [0, 0, 0]  # no keys set: every layer full, as before
    assert list(layer_windows(_model(3, sliding_window=128))) == [128, 128, 128]  # Mistral: every layer
    gpt_oss = _model(4, sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 2)
    assert list(layer_windows(gpt_oss)) == [128, 0, 128, 0] and ranges(gpt_oss) == []
    bad = _model(3, sliding_window=0, layer_types=["sliding_attention", "local"], attn_logit_softcapping=-1.0)
    problems = ranges(bad)
    assert len(problems) == 4 and all("model." in p for p in problems), problems


@pytest.mark.parametrize("path", PATHS)
def test_bfloat16_inputs(path):
    """bf16 q, k, v (fp32 sinks, as the model keeps them in its stored dtype): the output and every
    gradient keep their input's dtype and stay within bf16's error of the float64 definition
    (measured worst: 6.9e-3 relative, bf16's epsilon being 7.8e-3)."""
    q, k, v, ct, sinks, segments = _inputs(seed=4)
    want = _torch_reference(q, k, v, ct, 5, sinks, 4.0, None, segments)
    attention = _one_device(path)
    q16, k16, v16 = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))

    def loss(q, k, v, sinks):
        out = attention(q, k, v, jnp.asarray(segments), 5, sinks, 4.0, None)
        return jnp.sum(out.astype(jnp.float32) * jnp.asarray(ct, jnp.float32)), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
        q16, k16, v16, jnp.asarray(sinks, jnp.float32)
    )
    assert out.dtype == jnp.bfloat16 and [g.dtype for g in grads] == [jnp.bfloat16] * 3 + [jnp.float32]
    got = (np.asarray(out, np.float32), dict(zip(("q", "k", "v", "sinks"), (np.asarray(g, np.float32) for g in grads))))
    _assert_matches(got, want, rtol=1.5e-2)
