"""A workflow of the endpoint tests: one question through the openai SDK's HTTP client and the
episode's OpenAI endpoint (ctx.openai_base_url), errors left to propagate as a framework's would."""

from __future__ import annotations

import openai

from polyrl_runtime.workflows.api import EpisodeContext, Workflow


class AskOnce(Workflow):
    async def run_episode(self, ctx: EpisodeContext) -> dict[str, float]:
        url = await ctx.openai_base_url("solver")
        async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0) as client:
            reply = await client.chat.completions.create(
                model="solver", messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
        return {"solver": float(bool(reply.choices[0].message.content))}
