# The SKVQ methods' greedy tokens of python/tests/test_cuda.py::test_generate_matches_cpu on this
# machine's CPU with each packed-decode instruction set (run from python/tests); compare with the
# H200 run's CUDA and host-CPU tokens in test_cuda.log.
import sys

import torch

import veloxquant
from veloxquant import _veloxquant as _vq
sys.path.insert(0, ".")
from test_cuda import llama64, SPECS
from conftest import kv
g = torch.Generator().manual_seed(1)
ids = torch.randint(3, 128, (1, 70), generator=g)
args = dict(max_new_tokens=24, do_sample=False, pad_token_id=0)
for isa in ["avx512vnni", "avx512", "portable"]:
    print(isa, "->", _vq._set_cpu_attention_isa(isa))
    for name in ["skvq", "snapkv+skvq"]:
        out = llama64().generate(ids, **kv(veloxquant.Cache(SPECS[name])), **args)[0, 70:].tolist()
        print(" ", name, out)
