"""What multi-head latent attention (DeepSeek-V3) keeps, for memory.estimate (docs/kernels/mla.md)."""

import dataclasses

from ..validation import check_positive_int


@dataclasses.dataclass(frozen=True)
class MLA:
    """A layer's multi-head latent attention: `heads` heads, q and k of `nope` + `rope` dims, v of `value`,
    the query's low rank `q_rank` (None: one q_proj) and the key/value latent's `kv_rank`.

    Under "selective" it keeps the four matmul outputs q and k are rebuilt from (q_a_proj's q_rank, q_b_proj's
    heads*(nope + rope) or q_proj's, kv_a_proj_with_mqa's kv_rank + rope, kv_b_proj's heads*(nope + value), of
    which attention's v is a view), attention's output heads*value and the two latent norms' fp32 statistics;
    under "none" also the rebuilt q and k (2*heads*(nope + rope)), the rotated k_rot (rope) and the latent norms'
    outputs. Under autocast with norms weighted in another dtype each latent norm keeps a row of
    ones (q_rank + kv_rank elements, not per token)."""

    role = "attention"  # memory.parts' role: in place of Attention
    heads: int
    nope: int
    rope: int
    value: int
    kv_rank: int
    q_rank: int = None

    def __post_init__(self):
        for name in ("heads", "nope", "rope", "value", "kv_rank"):
            check_positive_int(getattr(self, name), name)
        if self.q_rank is not None:
            check_positive_int(self.q_rank, "q_rank")

    def keep(self, kept, s):
        """memory.parts' protocol: attention's part of a layer whose attention is latent ("attention-kept" caches
        the output, heads*value wide, and the logsumexp)."""
        if s.recompute == "full":
            return
        kept.update(o=s.t * self.heads * self.value * s.e, lse=s.heads * s.t * s.acc)
        if s.rebuilds:
            kept.update(self.kept(s.t, s.e, s.acc, s.recompute, s.norm_stats, ones=s.er != s.e))

    def kept(self, tokens, size, acc, recompute="selective", norm_stats=True, ones=False):
        """Parts (bytes) replacing a Llama layer's q/k/v and o for `tokens` tokens; size / acc: element sizes of
        the layer's dtype and of its fp32 (or fp64) statistics; ones: the latent norms keep a row of ones."""
        t, heads, qk = tokens, self.heads, self.nope + self.rope
        q_rank = self.q_rank or 0
        latent_norms = 1 + (self.q_rank is not None)
        parts = {"qkv": t * (q_rank + heads * qk + self.kv_rank + self.rope + heads * (self.nope + self.value)) * size,
                 "o": t * heads * self.value * size}
        if norm_stats:
            parts["latent_norm_stats"] = latent_norms * t * acc
        if ones:
            parts["latent_norm_ones"] = (q_rank + self.kv_rank) * size
        if recompute == "none":
            parts["mla_qk"] = t * (2 * heads * qk + self.rope) * size
            parts["latent_norm_out"] = t * (q_rank + self.kv_rank) * size
        return parts
