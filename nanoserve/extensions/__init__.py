"""The extensions: features beyond the walkthrough. Each is a module of its own that plugs into the core at
a named seam. The core is nanoserve/*.py, nanoserve/models/ and nanoserve/layers/. It never imports them.

- spec_decode.py: n-gram speculative decoding (draft tokens for the decodes);
- structured_outputs.py: grammars compiled with xgrammar (JSON schema, regex, choice, EBNF);
- logits_processors.py: penalties, logit_bias, min_tokens and grammar masks on the logits;
- compilation.py, cuda_graphs.py: the compiled step, and CUDA graphs for decode steps;
- quantization.py: int8 weight-only quantization, applied as the weights load;
- parallel.py: tensor parallelism's worker processes.
"""
