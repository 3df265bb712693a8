"""A black-box agent of your own, whole: any code that plays an episode against the
gateway over HTTP (here plain `httpx` and the chat completions route; an agent framework's
loop fits the same way).

Train with it (from the repository root):

  python -m jaxagent.train --config configs/tiny.yaml agent.kind=examples/own_agent.py:run_agent

`agent.kind` names `module:function` (a module on the path, or a .py file). The run
calls the function once an episode, as it calls the built-in harnesses
(`jaxagent.blackbox.run_openai_agent`): the environment, the task, the gateway's URL, then
the session id, the run's sampling and budgets as keywords. It must send every call
with the header `X-Session-Id: session_id` (the server records its turns under it: the
trajectory is read back from that record, token for token; the id holds a secret part,
so no other episode's agent can write into it), sample as the run trains (its
temperature, top_p and top_k: a turn sampled otherwise stops the run), hand each reply
to `env.step` as text (`jaxagent.blackbox.reply_text`: its content and its tool calls,
which the gateway returns apart), and return the rewards of its steps (the run trains the
environment's own, as `env.step` returned them). A gateway that fails
(an HTTP error) ends the episode as the infrastructure's, re-rolled.
"""

import httpx

from jaxagent.blackbox import gateway_turn, reply_text, turn_seed


async def run_agent(env, task, base_url: str, *, session_id: str, model: str = "policy",
                    max_turns: int = 8, max_tokens: int = 32, temperature: float = 1.0,
                    top_p: float = 1.0, top_k: int = 0,
                    turn_timeout_s: float = 600.0) -> list[float]:
  rewards = []
  obs = await env.reset(task)
  messages = list(obs.messages)
  # (no client timeout: `gateway_turn` asks the gateway how a slow turn stands, and
  # waits on one whose tokens keep coming)
  async with httpx.AsyncClient(base_url=base_url, timeout=None,
                               headers={"X-Session-Id": session_id}) as client:
    for turn in range(max_turns):
      # (a seed per session and turn, optional: an evaluation of the run then plays the
      # same episodes each time; without one the gateway draws its own)
      body = {"model": model, "messages": messages, "max_tokens": max_tokens,
              "temperature": temperature, "top_p": top_p, "top_k": top_k,
              "seed": turn_seed(session_id, turn)}
      if obs.tools:
        body["tools"] = obs.tools
      r = await gateway_turn(client.post("/v1/chat/completions", json=body), base_url,
                             session_id, turn_timeout_s)
      r.raise_for_status()
      # (a tool call the gateway parsed is in tool_calls, not in the content: the text
      # handed on holds both, as the chat template writes them)
      reply = reply_text(r.json()["choices"][0]["message"])
      messages.append({"role": "assistant", "content": reply})
      step = await env.step(reply)
      rewards.append(float(step.reward))
      messages += step.observation.messages
      if step.terminated or step.truncated:
        break
  return rewards
