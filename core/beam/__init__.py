"""Beam search: a select stage beside the sampler and the speculator (``stage``), the search
rules of one group (``search``) and the router the engine selects through (``route``)."""

from lmplug.beam.search import BeamGroup, Hypothesis

__all__ = ["BeamGroup", "Hypothesis"]
