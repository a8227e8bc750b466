"""The multi-token-prediction (MTP) head of the hybrid family (Qwen3-Next, Qwen3.5).

The head drafts the token after next from what the target model already computed: for row
t it reads the target's hidden state at position t and the token at t + 1, and predicts the
token at t + 2. Semantics follow vLLM's `qwen3_next_mtp.py` / `qwen3_5_mtp.py` and its
EAGLE-style proposer (`v1/spec_decode/llm_base_proposer.py`):

- `hidden` is the target's *final-normed* hidden state, the same tensor its lm_head reads
  (vLLM's target model returns `norm(x)` and the proposer passes that on), i.e. what
  `hybrid_forward` returns; no pre-norm residual is needed.
- x = fc([norm_e(embed(token at t + 1)) ; norm_h(hidden at t)]), the embedding half first
  (the checkpoint's `mtp.fc.weight` is [D, 2D], its first D input columns read the
  embedding); then one pre-norm full-attention block (gated attention, partial RoPE, the
  model's MLP kind), the head's own final norm and the *model's* lm_head.
- The block's attention runs at position t (the hidden state's position, not the token's):
  the proposer shifts the tokens by one and keeps the target's positions.
- k > 1 drafts chain: draft j + 1 reads draft j's token and the head's own output hidden
  (after its final norm, the tensor the logits came from) at position p + j + 1, and its
  attention sees the rows of the drafts before it (vLLM writes them to the head's K/V cache).

No cache here: attention is causal among the rows handed in, in row order, so the rows must
be consecutive positions of one sequence. Given the whole sequence this equals vLLM's head
(whose K/V cache holds every earlier row); given a suffix, the rows before it are not seen.
RoPE makes scores depend on position differences only, so without a cache an offset in
`positions` changes nothing; it starts to matter once the head's K/V are cached.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.config import ModelConfig
from jaxllm.model.forward import lm_head
from jaxllm.model.gated_attention import input_projections
from jaxllm.model.hybrid import block_mlp
from jaxllm.model.layers import apply_rope, project, rms_norm, rope_inv_freq
from jaxllm.params import GatedAttentionParams, MtpParams, Params


def _causal_gated_attention(
    h: jax.Array, p: GatedAttentionParams, positions: jax.Array, cfg: ModelConfig, n_seqs: int
) -> jax.Array:
    """Gated attention (as `gated_attention`) of [S * T, D] normed rows, `n_seqs` sequences of
    T rows each one after another, over themselves, causal by row order within each sequence;
    no cache, since the head's K/V exist only for the rows it is given."""
    eps = cfg.rms_eps
    q, gate, k, v = input_projections(h, p, cfg)  # q, gate [S * T, H, Dh]; k, v [S * T, K, Dh]
    q, k = rms_norm(q, p.q_norm, eps), rms_norm(k, p.k_norm, eps)
    inv_freq = rope_inv_freq(cfg)
    q = apply_rope(q, positions, inv_freq)
    k = apply_rope(k, positions, inv_freq)
    seqs = lambda a: a.reshape(n_seqs, -1, *a.shape[1:])  # noqa: E731  [S, T, heads, Dh]
    # grouped K/V heads are shared by H / K query heads, softmax scale 1/sqrt(Dh)
    attn = jax.nn.dot_product_attention(seqs(q), seqs(k), seqs(v), is_causal=True).reshape(q.shape)
    attn = attn * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(attn.dtype)
    return project(attn, p.wo, 2)  # [S * T, D]


def _mtp(params: Params, cfg: ModelConfig) -> MtpParams:
    if params.mtp is None or not cfg.mtp_layers:
        raise ValueError("this model has no MTP head (the checkpoint ships no mtp.* tensors)")
    return params.mtp


def mtp_forward(
    params: Params,
    cfg: ModelConfig,
    hidden: jax.Array,
    next_tokens: jax.Array,
    positions: jax.Array,
    *,
    layer: int = 0,
) -> tuple[jax.Array, jax.Array]:
    """Draft logits for the token two ahead of each row, for T consecutive rows of one sequence.

    Args:
      params: the model's params with `params.mtp` (the head; embed and lm_head are the model's).
      cfg: config (static under jit).
      hidden: [T, D] the target model's final-normed hidden state at positions t.
      next_tokens: [T] int, the token at t + 1 (the one the target sampled from that state).
      positions: [T] int, t (consecutive, ascending: attention is causal by row order).
      layer: which MTP layer runs (static); vLLM's draft step j runs layer j % mtp_layers.

    Returns:
      (float32 logits [T, V] for the token at t + 2, the head's hidden [T, D] after its final
      norm, which the next draft in a chain reads in place of the target's hidden).
    """
    valid = jnp.ones(hidden.shape[:1], bool)
    head_hidden = _head_rows(params, cfg, hidden[None], next_tokens[None], positions[None], valid[None], layer)[0]
    return lm_head(params, head_hidden), head_hidden


def _head_rows(
    params: Params,
    cfg: ModelConfig,
    hidden: jax.Array,
    next_tokens: jax.Array,
    positions: jax.Array,
    valid: jax.Array,
    layer: int = 0,
) -> jax.Array:
    """The head up to its final norm for S sequences of T consecutive rows each, in the same
    products: hidden [S, T, D], next_tokens and positions [S, T], valid [S, T] (rows whose
    routed experts run; the others' outputs are not meaningful). Returns [S, T, D]."""
    mtp = _mtp(params, cfg)
    S, T, D = hidden.shape
    dt, eps = mtp.fc.dtype, cfg.rms_eps  # the compute dtype is the weights' (RuntimeOptions.dtype)
    flat = lambda a: a.reshape(S * T, *a.shape[2:])  # noqa: E731
    emb = rms_norm(params.embed[flat(next_tokens)].astype(dt), mtp.norm_embedding, eps)  # [S * T, D]
    hid = rms_norm(flat(hidden).astype(dt), mtp.norm_hidden, eps)  # [S * T, D]
    x = project(jnp.concatenate([emb, hid], axis=-1), mtp.fc)  # [S * T, 2D] x [2D, D] -> [S * T, D]
    lp = jax.tree.map(lambda w: w[layer], mtp.block)
    x = x + _causal_gated_attention(rms_norm(x, lp.attn_norm, eps), lp.mixer, flat(positions), cfg, S)
    out, _ = block_mlp(rms_norm(x, lp.mlp_norm, eps), lp.mlp, cfg, flat(valid))
    x = x + out
    return rms_norm(x, mtp.final_norm, eps).reshape(S, T, D)


def mtp_draft(
    params: Params,
    cfg: ModelConfig,
    hidden_last: jax.Array,
    token: jax.Array,
    position: jax.Array,
    k: int,
) -> tuple[jax.Array, jax.Array]:
    """k greedy drafts for one sequence, chained through the head's own hidden state.

    Draft 0 is `mtp_forward` on the given rows, read at the last one; draft j + 1 appends a
    row (the head's hidden of the row before, draft j as its token, the next position) and
    is read there. Rows attend causally to every earlier row, the given ones included, as
    the drafts of vLLM's proposer attend to the head's K/V cache; this equals k calls of
    `mtp_forward` on the growing rows.

    Args:
      params, cfg: as `mtp_forward` (cfg static); the head must have one layer (the shipped
        checkpoints': with several, vLLM's steps use different layers whose caches differ).
      hidden_last: [D] the target's final-normed hidden at the last accepted position p,
        or [T, D] for the last T positions (context the drafts' attention sees).
      token: [] or [T] int, the token at p + 1 (at each row's position + 1).
      position: [] or [T] int, p (each row's position).
      k: drafts to make (static, >= 1).

    Returns:
      (draft tokens [k] int32 for positions p + 2 .. p + k + 1, their float32 logits [k, V]).
    """
    hidden = jnp.atleast_2d(hidden_last)[None]  # [1, T, D]
    tokens = jnp.atleast_1d(token)[None]
    positions = jnp.atleast_1d(position)[None]
    drafts, logits = _draft_chains(params, cfg, hidden, tokens, positions, jnp.ones((1,), bool), k, keep_logits=True)
    assert logits is not None
    return drafts[0], logits[0]


def _draft_chains(
    params: Params,
    cfg: ModelConfig,
    hidden: jax.Array,
    tokens: jax.Array,
    positions: jax.Array,
    live: jax.Array,
    k: int,
    *,
    keep_logits: bool,
) -> tuple[jax.Array, jax.Array | None]:
    """k greedy drafts for each of S sequences from its T given rows (hidden [S, T, D],
    tokens and positions [S, T], live [S]), all chains in the same products: (drafts [S, k]
    int32, their float32 logits [S, k, V] or None). See `mtp_draft`."""
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    if cfg.mtp_layers != 1:
        raise ValueError(f"drafts chain a one-layer head; this model's has {cfg.mtp_layers}")
    S, T, D = hidden.shape
    n = T + k - 1  # rows of a whole chain; row T - 1 + j yields draft j
    # Later rows start as zeros and route no experts until they are filled: causal attention
    # keeps them from the rows read so far, and each MLP row depends on its own row only.
    dt = _mtp(params, cfg).fc.dtype
    hid = jnp.zeros((S, n, D), dt).at[:, :T].set(hidden.astype(dt))
    tok = jnp.zeros((S, n), jnp.int32).at[:, :T].set(tokens.astype(jnp.int32))
    pos = positions.astype(jnp.int32)
    pos = jnp.concatenate([pos, pos[:, -1:] + 1 + jnp.arange(k - 1, dtype=jnp.int32)[None, :]], axis=1)
    rows = jnp.arange(n)[None, :]

    def step(j, carry):
        hid, tok, drafts, logits_out = carry
        row = T - 1 + j
        head = _head_rows(params, cfg, hid, tok, pos, live[:, None] & (rows <= row))
        read = jax.lax.dynamic_index_in_dim(head, row, axis=1, keepdims=False)  # [S, D]
        logits = lm_head(params, read)  # the vocabulary product for the row read only
        draft = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        nxt = jnp.minimum(row + 1, n - 1)  # the last step writes nowhere new (k - 1 chain rows)
        write = row + 1 < n
        hid = jnp.where(write, hid.at[:, nxt].set(read), hid)
        tok = jnp.where(write, tok.at[:, nxt].set(draft), tok)
        if keep_logits:
            logits_out = logits_out.at[:, j].set(logits)
        return hid, tok, drafts.at[:, j].set(draft), logits_out

    logits0 = jnp.zeros((S, k, cfg.vocab_size) if keep_logits else (0,), jnp.float32)
    _, _, drafts, logits = jax.lax.fori_loop(0, k, step, (hid, tok, jnp.zeros((S, k), jnp.int32), logits0))
    return drafts, logits if keep_logits else None


def mtp_draft_slots(
    params: Params,
    cfg: ModelConfig,
    hidden: jax.Array,
    token: jax.Array,
    position: jax.Array,
    live: jax.Array,
    k: int,
) -> jax.Array:
    """k greedy drafts for each of S sequences (a verification round's slots) at once.

    Row s equals `mtp_draft(params, cfg, hidden[s], token[s], position[s], k)[0]` where
    `live[s]`; the other rows route no experts and draft tokens nobody reads. Every draft step
    runs all S sequences' chains in the same products, and the vocabulary product only for the
    row each chain reads, so the head reads its weights and the lm_head k times a round
    whatever S is (one sequence at a time it read them S * k times).

    Args:
      params, cfg: as `mtp_forward` (cfg static; a one-layer head, as `mtp_draft`).
      hidden: [S, D] the target's final-normed hidden at each sequence's last accepted position p.
      token: [S] int, the token at p + 1; position: [S] int, p.
      live: [S] bool, the sequences whose drafts are wanted.
      k: drafts per sequence (static, >= 1).

    Returns:
      draft tokens [S, k] int32 for positions p + 2 .. p + k + 1.
    """
    drafts, _ = _draft_chains(
        params, cfg, hidden[:, None], token[:, None], position[:, None], live, k, keep_logits=False
    )
    return drafts
