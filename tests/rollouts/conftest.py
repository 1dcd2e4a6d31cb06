"""A `Policy` over one engine whose client is scripted (no vLLM): what sources sample through."""

from __future__ import annotations

from types import SimpleNamespace

from grpod.config import InferenceConfig
from grpod.inference.policy import Policy
from grpod.inference.supervised import SupervisedInference


def scripted_policy(client, version: int = 4, served_name: str = "policy") -> tuple[Policy, SupervisedInference]:
    """The real `Policy` and lease path over one open engine whose `client` is `client`. A sync
    landing while a request runs: set `engine.version` from inside the scripted call."""
    process = SimpleNamespace(running=True, pid=None, base_url="http://127.0.0.1:9", cfg=InferenceConfig(),
                              gpu=False, served_model_names=lambda lora=False: ["policy"])
    engine = SupervisedInference(process, InferenceConfig(), name="engine-0")
    engine.client, engine.version = client, version
    engine.open()
    policy = Policy([engine], version=version)
    policy.publish(version, served_name)
    return policy, engine
