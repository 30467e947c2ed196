"""`moeserve serve --hf-overrides JSON` (vLLM's flag) reaches the engine's config; a malformed
value stops the command line before anything loads."""

from __future__ import annotations

import argparse
import json

import pytest

from service.settings import add_arguments, from_namespace

YARN = {
    "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}
}


def test_the_flag_reaches_the_engine_config():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    settings = from_namespace(parser.parse_args(["--hf-overrides", json.dumps(YARN)]))
    assert json.loads(settings.engine_limits()["hf_overrides"]) == YARN


@pytest.mark.parametrize("value", ["{not json", "[1]", '{"rope_scaling": 4}'])
def test_a_malformed_value_stops_the_command_line(value, capsys):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--hf-overrides", value])
    assert "argument --hf-overrides" in capsys.readouterr().err
