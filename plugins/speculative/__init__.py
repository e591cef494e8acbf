"""First-party drafters for speculative decoding (``speculative: {method: NAME, num_tokens: k}``).

- ``ngram``: prompt lookup, no model;
- ``draft_model``: a smaller model with the same tokenizer, with its own KV cache;
- ``layer_skip``: the target's own first layers and its head as the draft;
- ``medusa``: heads on the target's hidden state (FasterDecoding format; train with
  ``lmplug train-drafter --method medusa MODEL OUT``);
- ``eagle``: an EAGLE-1/2 head (fc + one decoder layer) over the target's features (train with
  ``lmplug train-drafter --method eagle MODEL OUT``);
- ``mtp``: the checkpoint's multi-token-prediction module (DeepSeek-V3, GLM-4.5, Qwen3-Next
  layouts), or one trained with ``lmplug train-drafter --method mtp MODEL OUT``.

Acceptance rules (``speculative: {..., acceptance: {rule: NAME}}``, ``acceptance.py``): ``exact``
(the default), and the lossy ``typical``, ``cascade`` and ``route``.
"""

from lmplug.api import hookimpl

LMPLUG_API_VERSION = 3


@hookimpl
def lmplug_register_speculative_methods() -> list[type]:
    from lmplug_speculative.dflash import DFlashDrafter
    from lmplug_speculative.draft_model import DraftModelDrafter, LayerSkipDrafter
    from lmplug_speculative.eagle import EagleDrafter
    from lmplug_speculative.medusa import MedusaDrafter
    from lmplug_speculative.mtp import MTPDrafter
    from lmplug_speculative.ngram import NgramDrafter

    return [NgramDrafter, DraftModelDrafter, LayerSkipDrafter, MedusaDrafter, EagleDrafter, MTPDrafter,
            DFlashDrafter]


@hookimpl
def lmplug_register_acceptance_rules() -> list[type]:
    from lmplug_speculative.acceptance import CascadeRule, ExactRule, RouteRule, TypicalRule

    return [ExactRule, TypicalRule, CascadeRule, RouteRule]
