"""How answers are written down in the built-in datasets: GSM8K's `#### <number>` line and LaTeX's `\\boxed{}`.

Pure string functions, read by the data loaders (rewards/datasets.py, for gold answers) and by the verifiers
(rewards/gsm8k.py, rewards/math_answer.py, for gold answers and responses). They import nothing from the project.
"""

GSM8K_MARKER = "####"
"""A GSM8K solution ends in `#### <number>`; responses trained on it do too."""

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def gsm8k_gold_answer(answer_field: str) -> str:
    """The dataset's `answer` holds a worked solution ending in `#### 18`; a bare `18` is accepted as is."""
    if GSM8K_MARKER in answer_field:
        return answer_field.rsplit(GSM8K_MARKER, 1)[1].strip()
    return answer_field.strip()


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (nested braces balanced), or of `\\boxed 5`; None when absent."""
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    i = text.index("\\", start) + 1
    while i < len(text) and text[i].isalpha():
        i += 1
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text):
        return None
    if text[i] != "{":
        # `\boxed 5`: the argument runs to the next whitespace or `$`.
        end = i
        while end < len(text) and not text[end].isspace() and text[end] != "$":
            end += 1
        return text[i:end] or None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None
