"""An independent fill reference built from transformers' own modules (not our model code):
lower layers from its hidden states, late layers written out by hand from its submodules.

Llama / Qwen3 (one RoPE, pre-MLP norm named post_attention_layernorm) and Gemma 3 (a RoPE per
layer type, local layers with a sliding window, four norms per layer, query_pre_attn_scalar) are
told apart by what transformers' modules carry, as in modeling_gemma3.py."""

from __future__ import annotations

import torch


@torch.no_grad()
def reference_tail_logits(
    hf, ids: list[int], split: int, tail: int, predict=None, nofill=False, exact_rows=(), want_mass=False
):
    """Logits [tail, V] of the tail rows when prefix rows' late K/V come from predict(layer, x_S)
    (None with nofill: the late layers see only the tail). `exact_rows` (prefix positions) run
    the late layers exactly, together with the tail, over the filled cache; their K/V replace
    the filled ones. Also returns each late layer's filled prefix (k, v) [P, Hkv, D] after RoPE,
    and with want_mass the attention each prefix row receives from the late rows [P] (summed
    over late layers, heads and rows: what the probe ranks by when the probe rows are the tail)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # Gemma 3 rotates the same way

    m = hf.model
    n = len(ids)
    p = n - tail
    # the reference writes neither softcap (our loader refuses both)
    assert getattr(hf.config, "final_logit_softcapping", None) is None
    assert getattr(hf.config, "attn_logit_softcapping", None) is None
    hidden = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    x_split = hidden[split][0]  # [N, d] input of layer `split` (Gemma: its embedding already scaled)
    pos = torch.arange(n)[None]
    # Gemma 3's rotary_emb holds one inverse-frequency table per layer type and is called with the
    # layer's type (Gemma3TextModel.forward); Llama / Qwen3 have a single table.
    per_type = hasattr(m.rotary_emb, "layer_types")
    layer_types = getattr(hf.config, "layer_types", None)
    rope = {}
    rows = torch.tensor(sorted(exact_rows) + list(range(p, n)))  # [R] positions run exactly
    r = len(rows)
    h = x_split[rows]
    filled = {}
    mass = torch.zeros(p)
    for layer_id in range(split, hf.config.num_hidden_layers):
        layer = m.layers[layer_id]
        at = layer.self_attn
        hd = at.head_dim
        kind = layer_types[layer_id] if layer_types is not None else "full_attention"
        table = kind if per_type else None
        if table not in rope:
            extra = (kind,) if per_type else ()
            rope[table] = m.rotary_emb(x_split[None], pos, *extra)  # (cos, sin) [1, N, D] each
        cos, sin = rope[table]
        # a local layer's query at q sees keys j with q - j < window (sliding_window_overlay)
        window = hf.config.sliding_window if kind == "sliding_attention" else None

        def kv_of(x, at_pos):
            xn = layer.input_layernorm(x)
            k = at.k_proj(xn).view(x.shape[0], -1, hd)
            if hasattr(at, "k_norm"):
                k = at.k_norm(k)
            v = at.v_proj(xn).view(x.shape[0], -1, hd)
            k = k.transpose(0, 1)[None]  # [1, Hkv, L, D]
            _, k = apply_rotary_pos_emb(k, k, cos[:, at_pos], sin[:, at_pos])
            return k[0].transpose(0, 1), v  # [L, Hkv, D]

        hn = layer.input_layernorm(h)
        q = at.q_proj(hn).view(r, -1, hd)
        if hasattr(at, "q_norm"):
            q = at.q_norm(q)
        qh = q.transpose(0, 1)[None]
        qh, _ = apply_rotary_pos_emb(qh, qh, cos[:, rows], sin[:, rows])
        k_t, v_t = kv_of(h, rows)
        if nofill:
            keys, vals, key_pos = k_t, v_t, rows
        else:
            k_p, v_p = kv_of(predict(layer_id, x_split[:p]), torch.arange(p))
            filled[layer_id] = (k_p.clone(), v_p.clone())
            keys, vals = torch.cat([k_p, k_t[r - tail :]]), torch.cat([v_p, v_t[r - tail :]])
            keys[rows[: r - tail]], vals[rows[: r - tail]] = k_t[: r - tail], v_t[: r - tail]
            key_pos = torch.arange(n)
        groups = qh.shape[1] // keys.shape[1]
        kk = keys.transpose(0, 1).repeat_interleave(groups, 0)  # [H, K, D]
        vv = vals.transpose(0, 1).repeat_interleave(groups, 0)
        scores = qh[0] @ kk.transpose(1, 2) * at.scaling  # [H, T, K]; Gemma: query_pre_attn_scalar**-0.5
        mask = key_pos[None, :] <= rows[:, None]  # [R, K]
        if window is not None:
            mask &= rows[:, None] - key_pos[None, :] < window
        scores = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        if not nofill:
            mass += scores[:, :, :p].sum(dim=(0, 1))
        out = (scores @ vv).transpose(0, 1).reshape(r, -1)  # [R, H*D]
        if hasattr(layer, "pre_feedforward_layernorm"):
            # Gemma 3's sandwich: its post_attention_layernorm normalizes the attention output
            # before the residual add; the MLP sits between pre_ and post_feedforward_layernorm
            h = h + layer.post_attention_layernorm(at.o_proj(out))
            h = h + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(h)))
        else:
            h = h + at.o_proj(out)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
    logits = hf.lm_head(m.norm(h[r - tail :])).float()
    return (logits, filled, mass) if want_mass else (logits, filled)
