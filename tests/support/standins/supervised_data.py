"""Stand-in rows for the data the supervised recipes of the matrix read (support/recipe_cases/
supervised.py): a few short rows of each dataset's own columns, written deterministically, no network.

Texts are short on purpose: the tiny model's tokenizer has a 1024-token vocabulary and the server's
context is 2048 tokens, and every row is trained on or sampled from on 2 CPU cores.
Test support only.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from support.standins import write_jsonl

# Short question/answer pairs the chat stand-ins are made of (no_robots, OpenThoughts3).
QA_PAIRS: tuple[tuple[str, str], ...] = (
    ("Name three primary colors.", "Red, blue and yellow."),
    ("What is the capital of France?", "Paris is the capital of France."),
    ("Write a haiku about rain.",
     "Soft rain on the roof,\nthe garden drinks in silence,\nclouds drift to the east."),
    ("How many legs does a spider have?", "A spider has eight legs."),
    ("Suggest a name for a grey cat.", "How about Smokey?"),
    ("What is 12 times 3?", "12 times 3 is 36."),
    ("Summarize: The meeting moved to Friday.", "The meeting is now on Friday."),
    ("Give me a synonym for happy.", "Cheerful."),
    ("Which planet is closest to the sun?", "Mercury is the closest planet to the sun."),
    ("Rewrite politely: Give me the report.", "Could you please send me the report?"),
    ("What does a thermometer measure?", "It measures temperature."),
    ("List two fruits that are yellow.", "Bananas and lemons."),
    ("Is water wet?", "Water makes other things wet."),
    ("Classify: apple, carrot. Which is a fruit?", "The apple is a fruit."),
    ("Translate 'thank you' to Spanish.", "Gracias."),
    ("What day comes after Monday?", "Tuesday comes after Monday."),
    ("Brainstorm two names for a bakery.", "Rise and Shine, The Daily Crumb."),
    ("How do you boil an egg?", "Put it in boiling water for about nine minutes."),
    ("What is the opposite of cold?", "Hot."),
    ("Extract the year: Built in 1889 in Paris.", "1889"),
)

NO_ROBOTS_CATEGORIES = ("Generation", "Open QA", "Brainstorm", "Chat", "Rewrite", "Summarize",
                        "Coding", "Classify", "Closed QA", "Extract")


def _no_robots_row(index: int) -> dict[str, Any]:
    """One row of HuggingFaceH4/no_robots: prompt, prompt_id (sha256 of the prompt), messages
    ({content, role}), category. Its "Chat" rows open with a system message, as the real ones can."""
    prompt, answer = QA_PAIRS[index % len(QA_PAIRS)]
    category = NO_ROBOTS_CATEGORIES[index % len(NO_ROBOTS_CATEGORIES)]
    messages = [{"content": prompt, "role": "user"}, {"content": answer, "role": "assistant"}]
    if category == "Chat":
        messages.insert(0, {"content": "You are a friendly assistant.", "role": "system"})
    return {"prompt": prompt, "prompt_id": hashlib.sha256(prompt.encode()).hexdigest(),
            "messages": messages, "category": category}


def no_robots(folder: Path) -> dict[str, Path]:
    """HuggingFaceH4/no_robots: its two splits, train (16 rows) and test (4 rows)."""
    return {"train": write_jsonl(folder / "train.jsonl", (_no_robots_row(i) for i in range(16))),
            "test": write_jsonl(folder / "test.jsonl", (_no_robots_row(i) for i in range(16, 20)))}


def open_thoughts3(folder: Path) -> dict[str, Path]:
    """open-thoughts/OpenThoughts3-1.2M (train, streamed): difficulty, source, domain and
    conversations ({from, value}, "human" then "gpt" with its reasoning in <think> tags)."""
    domains = ("math", "code", "science")
    rows = []
    for index in range(16):
        question, answer = QA_PAIRS[index % len(QA_PAIRS)]
        reply = f"<think>\nThe question is short. {answer}\n</think>\n\n{answer}"
        rows.append({"difficulty": 1 + index % 10, "source": "stand-in", "domain": domains[index % 3],
                     "conversations": [{"from": "human", "value": question},
                                       {"from": "gpt", "value": reply}]})
    return {"train": write_jsonl(folder / "train.jsonl", rows)}


# (question, four options, index of the right one): short chemistry multiple-choice items.
CHEMISTRY_MCQ: tuple[tuple[str, tuple[str, str, str, str], int], ...] = (
    ("Which gas do plants take in?", ("Oxygen", "Carbon dioxide", "Helium", "Neon"), 1),
    ("What is the symbol for sodium?", ("S", "So", "Na", "Sd"), 2),
    ("What is the pH of pure water?", ("7", "1", "14", "10"), 0),
    ("Which is a noble gas?", ("Iron", "Argon", "Carbon", "Sulfur"), 1),
    ("H2O is the formula of?", ("Salt", "Sugar", "Ozone", "Water"), 3),
    ("Which is an acid?", ("Vinegar", "Soap", "Bleach", "Ammonia"), 0),
    ("How many protons has carbon?", ("12", "8", "6", "4"), 2),
    ("What is NaCl?", ("Table salt", "Baking soda", "Chalk", "Rust"), 0),
    ("Which metal is liquid at room temperature?", ("Lead", "Tin", "Zinc", "Mercury"), 3),
    ("What does a catalyst change?", ("The products", "The rate", "The mass", "The charge"), 1),
)


def _sciknoweval_row(question: str, options: tuple[str, ...], answer: int, domain: str, level: str,
                     kind: str) -> dict[str, Any]:
    """One row of hicai-zju/SciKnowEval: question, choices {text, label}, answerKey, answer, type,
    domain, details {level, task, subtask, source}, prompt {default}."""
    labels = ["A", "B", "C", "D"][: len(options)]
    return {"question": question, "choices": {"text": list(options), "label": labels},
            "answerKey": labels[answer], "answer": "", "type": kind, "domain": domain,
            "details": {"level": level, "task": "stand-in", "subtask": "stand-in", "source": "stand-in"},
            "prompt": {"default": "Answer the multiple-choice question with one letter."}}


def sciknoweval(folder: Path) -> dict[str, Path]:
    """hicai-zju/SciKnowEval (its one split, test): ten rows the recipe keeps by default (Chemistry,
    L3, a "mcq" type) and six it filters out (another domain, level or type)."""
    rows = [_sciknoweval_row(q, options, answer, "Chemistry", "L3", "mcq-4-choices")
            for q, options, answer in CHEMISTRY_MCQ]
    first, second = CHEMISTRY_MCQ[0], CHEMISTRY_MCQ[1]
    rows += [_sciknoweval_row(first[0], first[1], first[2], "Chemistry", "L2", "mcq-4-choices"),
             _sciknoweval_row(second[0], second[1], second[2], "Physics", "L3", "mcq-4-choices"),
             _sciknoweval_row("Water boils at 100 C at sea level.", ("True", "False"), 0, "Chemistry",
                              "L3", "true_or_false"),
             _sciknoweval_row("Gold rusts in air.", ("True", "False"), 1, "Chemistry", "L3",
                              "true_or_false"),
             _sciknoweval_row(first[0], first[1], first[2], "Biology", "L1", "mcq-4-choices"),
             _sciknoweval_row(second[0], second[1], second[2], "Material", "L4", "mcq-2-choices")]
    return {"test": write_jsonl(folder / "test.jsonl", rows)}


# (text, label) as prompt_distillation/create_data.py's teacher labels them (two-letter codes); the
# letters ruff finds ambiguous are the Turkish, Greek and Urdu the labels are about.
LANGUAGE_SAMPLES: tuple[tuple[str, str], ...] = (
    ("The cat is on the table.", "en"),
    ("Le chat est sur la table.", "fr"),
    ("El gato está en la mesa.", "es"),
    ("Die Katze ist auf dem Tisch.", "de"),
    ("Kedi masanın üstünde.", "tr"),  # noqa: RUF001
    ("Con mèo ở trên bàn.", "vi"),
    ("Кошка на столе.", "ru"),
    ("猫在桌子上。", "zh"),
    ("Η γάτα είναι στο τραπέζι.", "el"),  # noqa: RUF001
    ("बिल्ली मेज़ पर है।", "hi"),
    ("القطة على الطاولة.", "ar"),
    ("بلی میز پر ہے۔", "ur"),  # noqa: RUF001
    ("print(1 + 1)", "ot"),
    ("Thank you for the help, and see you soon.", "en"),
    ("Merci pour votre aide.", "fr"),
    ("Gracias por la ayuda.", "es"),
)


def prompt_distillation_rows() -> list[dict[str, Any]]:
    """What prompt_distillation/create_data.py writes: one conversation a line, the text as the
    user's message and the teacher's label alone as the assistant's."""
    return [{"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": label}]}
            for text, label in LANGUAGE_SAMPLES]
