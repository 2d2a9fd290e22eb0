"""A black-box agent (rollout.multi_turn.agent, docs/multi-turn.md#black-box-agents-an-openai-compatible-endpoint):
it asks the policy the row's question through the `openai` client, checks the answer against the row's ground truth
as a test harness would, and after a wrong answer says so and asks again. Its reward: 1 for a right first answer,
1/2 for a right second one, 0 otherwise (reward.name=env makes it the episode's reward).

    python -m rltrain.main_grpo rollout.engine=vllm rollout.mode=async rollout.max_new_tokens=24 \
        rollout.multi_turn.enabled=true rollout.multi_turn.max_turns=2 \
        rollout.multi_turn.agent.path=examples/agents/retry.py rollout.multi_turn.agent.name=answer_with_retry \
        reward.name=env
"""


def answer_with_retry(row, base_url, retries=1):
    import openai   # installed with vllm, which serving agents needs (rollout.engine=vllm)

    client = openai.OpenAI(base_url=base_url, api_key="rltrain", max_retries=0)   # the URL names the episode
    prompt = row["prompt"]
    messages = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    for attempt in range(retries + 1):
        try:
            reply = client.chat.completions.create(model="policy", messages=messages)
        except openai.BadRequestError as err:
            if err.code in ("context_length_exceeded", "max_turns_reached"):   # the episode's limits: it ends
                return 0.0
            raise
        message = reply.choices[0].message
        if (message.content or "").strip() == str(row["ground_truth"]).strip():
            return 1.0 / (attempt + 1)
        messages += [message, {"role": "user", "content": "no, again:"}]   # the reply as it came, then feedback
    return 0.0
