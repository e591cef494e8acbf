"""The architecture conformance kit for ``arcee``: tiny random transformers models of two configs
(one with tied embeddings and grouped KV heads), checked against transformers' own outputs."""

from typing import ClassVar

from lmplug.testing import ArchitectureConformance

TINY = {"model_type": "arcee", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_act": "relu2",
        "max_position_embeddings": 256}


class TestArceeArchitecture(ArchitectureConformance):
    backend = "arcee"  # found through this package's entry point
    configs: ClassVar[dict] = {"arcee": TINY,
               "arcee-tied-mha": {**TINY, "tie_word_embeddings": True, "num_key_value_heads": 4}}
