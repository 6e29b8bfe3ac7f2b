"""DeepSeek-V4.1's checkpoint name rules: which stored tensor is in which format,
which a load skips, which an export may leave out.

The storage format of every model tensor is fixed by its name (the decision
table in docs/design/checkpoints.md); the formats themselves, their shapes on
disk and their dequantisation are model-agnostic (engine/loader/formats.py).
The loader, the writer and the planners read these rules from the registry
(``ModelSpec.weights``, engine/model/registry.py), never from here.
"""

from __future__ import annotations

import re

from engine.model.weights import WeightFormat, WeightRules

# A text layer, or a DSpark stage (``mtp.<i>.``: an ordinary V4.1 block, stored alike).
_L = r"(layers|mtp)\.\d+\."
_MTP = r"mtp\.\d+\."
# First full match wins. Sources: vLLM deepseek_v41 (quant_config=None marks BF16
# projections; FP32 parameters are declared float32) and DeepSeek's checkpoints.
_FORMATS: tuple[tuple[str, WeightFormat], ...] = (
    (_L + r"ffn\.experts\.\d+\.w[123]\.weight", WeightFormat.MXFP4),
    (_L + r"engram\.embed\.weight", WeightFormat.FP8_ROWS),
    (_L + r"attn\.(wq_a|wq_b|wkv|wo_a|wo_b)\.weight", WeightFormat.FP8_BLOCK),
    (_L + r"attn\.indexer\.wq_b\.weight", WeightFormat.FP8_BLOCK),
    (_L + r"ffn\.shared_experts\.w[123]\.weight", WeightFormat.FP8_BLOCK),
    (_L + r"engram\.wkv\.weight", WeightFormat.FP8_BLOCK),
    # The drafter's context projection is quantised like the other dense projections
    # (vLLM builds it with the model's quant_config).
    (_MTP + r"main_proj\.weight", WeightFormat.FP8_BLOCK),
    (r"(.+\.)?\w*norm\.weight", WeightFormat.FP32),
    (_L + r"hc_(attn|ffn)_(fn|base|scale)", WeightFormat.FP32),
    (_L + r"attn\.attn_sink", WeightFormat.FP32),
    (_L + r"ffn\.gate\.bias(_vl)?", WeightFormat.FP32),
    (_L + r"attn\.compressor\.(wkv|wgate)\.weight", WeightFormat.BF16),
    (_L + r"attn\.indexer\.(wk|weights_proj)\.weight", WeightFormat.BF16),
    (_L + r"ffn\.gate\.weight", WeightFormat.BF16),
    (_L + r"engram\.[\w.]+", WeightFormat.BF16),
    (r"(embed|head)\.weight", WeightFormat.BF16),
    # The drafter's heads (its last stage): the Markov codes a plain embedding, the
    # Markov vocabulary bias and the confidence projection fp32 (SGLang's default,
    # DeepSeek's own fp32 ParallelHead).
    (_MTP + r"markov_head\.embed\.weight", WeightFormat.BF16),
    (_MTP + r"markov_head\.head\.weight", WeightFormat.FP32),
    (_MTP + r"confidence_head\.proj\.weight", WeightFormat.FP32),
    # The vision tower: every port loads it unquantised (vLLM's quant_config=None),
    # its norms in fp32, the span vectors declared fp32 (vLLM).
    (r"vision\.blocks\.\d+\.norm[12]\.weight", WeightFormat.FP32),
    (r"vision\.[\w.]+", WeightFormat.BF16),
    (r"aligner\.w[12]\.(weight|bias)", WeightFormat.BF16),
    (r"image_(start|newline|end)", WeightFormat.FP32),
)

# Tensors of the release the server does not serve: skipped with one notice per kind.
# (None since the DSpark drafter, ``mtp.*``, loads.)
SKIPPED_KINDS: tuple[tuple[str, tuple[str, ...]], ...] = ()

# The drafter's tensors: a checkpoint without any loads the text model alone.
DRAFTER_PREFIXES = ("mtp.",)

# The vision tower's tensors: loaded into a model built with a ``vision_config``,
# skipped (kind "vision") by a text-only one.
VISION_PREFIXES = ("vision.", "visual.", "aligner.", "image_")

# Model tensors an export may leave out, with the value they then take. The
# release stores ``ffn.gate.bias_vl`` (the router's selection bias for image
# tokens) for every MoE layer; an export without it (older text-only
# checkpoints, the demo model) loads as zeros: such a model routes an image
# position like text.
_OPTIONAL = (_L + r"ffn\.gate\.bias_vl",)

WEIGHTS = WeightRules(
    formats=tuple((re.compile(pattern), fmt) for pattern, fmt in _FORMATS),
    skipped_kinds=SKIPPED_KINDS,
    vision_prefixes=VISION_PREFIXES,
    drafter_prefixes=DRAFTER_PREFIXES,
    optional_tensors=tuple(re.compile(p) for p in _OPTIONAL),
)
