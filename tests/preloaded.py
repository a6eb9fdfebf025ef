"""What the test workers' fork server imports once (see tests/workers.py), so that a worker
forked from it imports nothing heavy again: torch and what its first optimizer imports
lazily, pyarrow and pandas (pyarrow imports pandas on a worker's first batch), sparkdl's
worker side, the tests' reference helpers, and transformers' model classes and peft where
they are installed.

Then it prepares as sparkdl's PySpark daemon does (:mod:`sparkdl.spark.daemon`): the first
optimizer built, and everything imported moved out of the garbage collector's sight, so a
worker's teardown ``gc.collect()`` walks the worker's own objects only. The one thread these
imports start, pyarrow's jemalloc background thread, is fork-safe (jemalloc's fork
handlers; a forked child starts its own when it needs one)."""

import pandas  # noqa: F401
import pyarrow  # noqa: F401

import sparkdl.spark.ps_host
import sparkdl.worker.assembly
import sparkdl.worker.own_loop  # noqa: F401
import tests.reference  # noqa: F401
from sparkdl.spark import daemon

try:  # the Hugging Face tests' models and adapters: about 6 s of CPU a worker, once here
    import peft  # noqa: F401
    from transformers import BertForSequenceClassification, GPT2LMHeadModel, LlamaForCausalLM  # noqa: F401
except ImportError:  # the hf extra is not installed: those tests are skipped
    pass

daemon._prepare()  # last: it freezes what the imports above brought in
