"""portarl's public fused ops, dispatched to a backend by the tensors' device.

- :func:`logprobs`: per-token log-probs (and entropy) from logits, fp32 accumulation.
- :func:`linear_logprobs`: the same from hidden states and an lm head, never holding N x V logits.
- :func:`kl`: per-token KL estimators k1 / k2 / k3 with documented clamps.
- :func:`computed_by`: which backend produced an op result.
"""

from portarl.ops._checks import SUPPORTED_DTYPES, computed_by
from portarl.ops._kl import KL_ESTIMATORS, kl
from portarl.ops._linear_logprobs import linear_logprobs
from portarl.ops._logprobs import logprobs

__all__ = ["KL_ESTIMATORS", "SUPPORTED_DTYPES", "computed_by", "kl", "linear_logprobs", "logprobs"]
