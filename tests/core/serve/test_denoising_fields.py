"""The server's ``denoising`` field (block diffusion) becomes ``SamplingParams.denoising``; bad
values, and what the engine refuses at admission (a denoising request to another model, an
autoregressive option on a block-diffusion model), are a 400 naming the field."""

from __future__ import annotations

import pytest

from lmplug.errors import ConfigError
from lmplug.serve.convert import admission_error, sampling_params
from lmplug.serve.errors import APIError
from lmplug.serve.protocol import CompletionRequest


def params(**body):
    return sampling_params(CompletionRequest(prompt=[5, 6, 7], max_tokens=4, **body), [[5, 6, 7]], 64, None)


def test_denoising_field_sets_the_params():
    sp = params(denoising={"max_denoising_steps": 8, "t_min": 0.2, "t_max": 0.9})
    assert (sp.denoising.max_denoising_steps, sp.denoising.t_min, sp.denoising.t_max) == (8, 0.2, 0.9)
    assert params().denoising is None


@pytest.mark.parametrize("denoising", [{"max_denoising_steps": 0}, {"max_denoising_steps": 5000},
                                       {"t_min": 0.5, "t_max": 0.5}, {"entropy_bound": 0},
                                       {"canvas_length": -1}, {"unknown": 1}])
def test_bad_denoising_values_are_a_400_naming_the_field(denoising):
    with pytest.raises(APIError) as info:
        params(denoising=denoising)
    assert info.value.status == 400 and info.value.param == "denoising"
    assert next(iter(denoising)) in str(info.value)


def test_admission_refusals_name_the_field():
    """The messages the denoising stage raises at admission (``lmplug.diffusion.stage``)."""
    from lmplug.diffusion.stage import DenoisingStage

    class Plain:  # a model that does not denoise
        pass

    stage = DenoisingStage(Plain(), None, 96, 64, 64, "llama")
    with pytest.raises(ConfigError) as info:
        stage.admit(params(denoising={"max_denoising_steps": 4}))
    err = admission_error(info.value, None)
    assert err.status == 400 and err.param == "denoising" and "not a block-diffusion model" in str(err)

    class Diffusion:
        block_diffusion, canvas_length = True, 4

    stage = DenoisingStage(Diffusion(), None, 96, 64, 64, "diffusion_gemma_text")
    for body, field in (({"top_p": 0.5}, "top_p"), ({"presence_penalty": 1.0}, "presence_penalty"),
                        ({"denoising": {"canvas_length": 8}}, "denoising")):
        with pytest.raises(ConfigError) as info:
            stage.admit(params(**body))
        err = admission_error(info.value, None)
        assert err.status == 400 and err.param == field, (body, str(err))
