"""No third-party warning reaches a lab's console: on a core install (no torch) loading the lab's
tokenizer, as the gateway and the simulator do, prints nothing; `kvlab doctor` says what matters."""

from __future__ import annotations

import subprocess
import sys

import pytest

# transformers decides "torch available" with importlib.util.find_spec: hide torch as a core
# install (`make lab`, no `make vllm`) lacks it, then do what every lab process does first
_LOAD = """
import importlib.util, sys
real = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a, **k: None if name.split('.')[0] == 'torch' else real(name, *a, **k)
{prelude}
from kvlab.tokenizer import Tokenizer
tok = Tokenizer()
assert tok.encode('hello world')
print('loaded', file=sys.stderr)
"""


def _stderr(prelude: str = "") -> str:
    done = subprocess.run([sys.executable, "-c", _LOAD.format(prelude=prelude)], capture_output=True,
                          text=True, timeout=120, check=True)
    return done.stderr


@pytest.mark.processes
def test_loading_the_tokenizer_without_torch_prints_no_third_party_warning():
    assert _stderr().strip() == "loaded"


@pytest.mark.processes
def test_the_check_sees_transformers_advice_when_kvlab_does_not_silence_it():
    """The probe above is able to fail: with the advice let through, transformers prints it."""
    err = _stderr("import os; os.environ['TRANSFORMERS_NO_ADVISORY_WARNINGS'] = ''; import transformers")
    assert "PyTorch was not found" in err
