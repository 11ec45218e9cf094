"""Prompts to token ids: raw completion text, a chat message (through the tokenizer's chat template), or ids."""

from specsplit.services.errors import InvalidArgument


def encode_prompt(tokenizer, prompt: str | list[int], chat: bool = False) -> list[int]:
    if isinstance(prompt, list):
        return list(prompt)
    if tokenizer is None:
        raise InvalidArgument("this model has no tokenizer: send prompt token ids instead of text")
    if not prompt:
        raise InvalidArgument("prompt must not be empty")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidArgument("this model's tokenizer has no chat template")
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)
    return tokenizer.encode(prompt, add_special_tokens=True)
