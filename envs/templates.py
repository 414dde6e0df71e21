"""Prompt templates: how a bare question becomes the text the model continues."""

from __future__ import annotations

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

NAMED_TEMPLATES = {
    # Base models continue plain text; the trailing "Answer:" starts their turn.
    "plain": "Question: {question}\n" + INSTRUCTION + "\nAnswer:",
    # The project's tiny character-level model is trained on "123+456=\\boxed{579}".
    "compact": "{question}=",
    # Instruct models: the tokenizer's own chat template around one user message.
    "chat": None,
}


def render_prompt(question: str, template: str = "plain", tokenizer=None) -> str:
    """The prompt text for `question`.

    `template` is one of NAMED_TEMPLATES or any string containing "{question}", which is
    replaced literally (other braces, such as "\\boxed{}", are left alone). "chat" needs a
    Hugging Face tokenizer with a chat template and ends with the assistant's turn opened.
    """
    if template == "chat":
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            name = getattr(tokenizer, "name_or_path", None) if tokenizer is not None else None
            raise ValueError(
                f"template='chat' needs a tokenizer with a chat template; got "
                f"{'no tokenizer' if tokenizer is None else f'{name!r} without one'}. "
                "Use template='plain' for base models."
            )
        messages = [{"role": "user", "content": f"{question}\n{INSTRUCTION}"}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if template in NAMED_TEMPLATES:
        return NAMED_TEMPLATES[template].replace("{question}", question)
    if isinstance(template, str) and "{question}" in template:
        return template.replace("{question}", question)
    raise ValueError(
        f"template={template!r} is neither a named template {sorted(NAMED_TEMPLATES)} "
        "nor a format string containing '{question}'"
    )
