__version__ = "0.1.0"

import logging as _logging

# peft and sentence-transformers import bitsandbytes, which on CPUs with AVX512-BF16 logs that it could not fetch an optional
# kernel from the hub ("pip install kernels"). Nothing a user can act on (the kernel is downloaded at run time, and runs are
# offline), so that one message is dropped, before any of our modules can import them.
_logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(
    lambda record: not record.getMessage().startswith("Failed to load CPU gemm_4bit_forward"))
