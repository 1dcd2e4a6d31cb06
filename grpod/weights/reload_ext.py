"""vLLM worker extension for bridge mode `none` (in place): reload the weights, then the output head.

Launched as `--worker-extension-cls grpod.weights.reload_ext.ReloadExtension`; the bridge calls
`grpod_reload_weights` through `collective_rpc` instead of vLLM's own `reload_weights`.

Why: with tied embeddings (SmolLM2, Qwen2.5 small models, Llama 3.2 1B/3B) vLLM's output head is
the embedding module itself, and on CPU its logits come from a copy of the weight packed for
oneDNN when the model was loaded (`dispatch_cpu_unquantized_gemm`). vLLM's in-place reload
writes the new embedding into the weight tensor but leaves that packed copy as it was: measured on
SmolLM2-135M after one step, vLLM then served the new body with the old head (its logprobs equal
HF's with the trained body and the untrained head to 4e-5, and differ from the trained model's by
0.014; the alignment probe caught it at 0.052). After the stock reload this extension runs the
embedding layers' post-load processing again, which packs the current weight; elsewhere (GPU) that
processing is a no-op for unquantized embeddings.

No import side effects: this module changes nothing in vLLM until the method is called.
"""

from __future__ import annotations

from grpod.inference.threads_ext import EngineThreads


class ReloadExtension(EngineThreads):
    def grpod_reload_weights(self, weights_path: str) -> int:
        """vLLM's in-place reload from `weights_path`, then the embedding/head layers re-processed
        from their current weights. Returns how many layers were re-processed."""
        self.reload_weights(weights_path=weights_path)
        return _reprocess_embeddings(self.model_runner.get_model())


def _reprocess_embeddings(model) -> int:
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        UnquantizedEmbeddingMethod,
    )

    done = 0
    seen: set[int] = set()
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, UnquantizedEmbeddingMethod) and id(module) not in seen:
            seen.add(id(module))
            method.process_weights_after_loading(module)
            done += 1
    return done
