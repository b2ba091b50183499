"""Regenerates ``tiny_corpus.txt``, the embedded demo corpus: ``python -m mcore.train.assets.generate_corpus``.

The text is original, composed from the templates below with a seeded ``random.Random`` (stable across Python
versions), so the file is reproducible byte for byte. It is small, plain English with a limited vocabulary and a
regular structure (short stories, letters, weather notes, counting rhymes), which a tiny byte-level GPT learns
visibly within a few hundred steps. Documents are separated by one blank line.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

SEED = 20261130
NUM_DOCUMENTS = 360
CORPUS_PATH = Path(__file__).with_name("tiny_corpus.txt")

NAMES = ["Pip", "Mira", "Tom", "Lena", "Otto", "Rosa", "Finn", "Ada", "Ben", "Nell", "Kit", "Ivy", "Sam", "Jo"]
KINDS = ["fox", "rabbit", "mouse", "owl", "bear", "duck", "cat", "dog", "hen", "frog", "goat", "crow"]
TRAITS = ["small", "brave", "shy", "curious", "kind", "clever", "sleepy", "quick", "quiet", "cheerful"]
PLACES = [
    "the old mill",
    "the green hill",
    "the quiet river",
    "the busy market",
    "the deep wood",
    "the stone bridge",
    "the sunny field",
    "the little harbor",
    "the apple orchard",
    "the windy beach",
]
THINGS = [
    "red kite",
    "blue lantern",
    "silver key",
    "warm scarf",
    "wooden boat",
    "jar of honey",
    "little map",
    "round stone",
    "paper star",
    "basket of plums",
]
HELPERS = ["an old turtle", "a wise heron", "a busy beaver", "a friendly horse", "a tall giraffe", "a gentle cow"]
FEELINGS = ["happy", "tired", "proud", "calm", "glad", "relieved"]
TIMES = ["One morning", "One evening", "On a rainy day", "Early one spring day", "Late one autumn night"]
WEATHER = ["sunny", "cloudy", "rainy", "windy", "foggy", "snowy", "warm", "cold"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
NUMBERS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
FRUITS = ["apple", "pear", "plum", "cherry", "lemon", "peach"]
MORALS = [
    "A friend in need is a friend indeed.",
    "Slow and steady can win the day.",
    "It is good to ask for help.",
    "Small steps can take you far.",
    "Sharing makes a good day better.",
    "Being kind costs nothing at all.",
]


def _story(rng: random.Random) -> str:
    name, kind, trait = rng.choice(NAMES), rng.choice(KINDS), rng.choice(TRAITS)
    place, other_place = rng.sample(PLACES, 2)
    thing, helper = rng.choice(THINGS), rng.choice(HELPERS)
    helper_name = helper.split(" ", 1)[1]
    lines = [
        f"{rng.choice(TIMES)}, a {trait} {kind} named {name} went to {place}.",
        rng.choice(
            [
                f"{name} was looking for a {thing}.",
                f"{name} had lost a {thing} and wanted to find it.",
                f"{name} could not find the {thing} anywhere.",
            ]
        ),
        f'"Where could it be?" asked {name}. "I had it {rng.choice(["yesterday", "this morning", "last week"])}."',
        rng.choice(
            [
                f"{name} looked under the trees and behind the rocks, but the {thing} was not there.",
                f"{name} looked in the grass and by the water, but the {thing} was not there.",
                f"{name} searched all day, but the {thing} was still lost.",
            ]
        ),
        f"Then {name} met {helper} near {other_place}.",
        f'"I can help you," said the {helper_name}. "Let us look together."',
    ]
    if rng.random() < 0.5:
        lines.append(f"They walked and walked until the sun was low and the sky was {rng.choice(['pink', 'gold'])}.")
    lines += [
        f"At last they found the {thing} by {rng.choice(PLACES)}.",
        f"{name} the {kind} was very {rng.choice(FEELINGS)} and thanked the {helper_name}.",
        rng.choice(MORALS),
    ]
    return "\n".join(lines)


def _letter(rng: random.Random) -> str:
    writer, reader = rng.sample(NAMES, 2)
    day, weather, place = rng.choice(DAYS), rng.choice(WEATHER), rng.choice(PLACES)
    count, fruit = rng.choice(NUMBERS[1:]), rng.choice(FRUITS)
    return "\n".join(
        [
            f"Dear {reader},",
            f"It is {day} and the weather here is {weather}.",
            f"Today I went to {place} and picked {count} {fruit}s.",
            f"I will bring you a {rng.choice(THINGS)} when I come to visit on {rng.choice(DAYS)}.",
            "Please write back soon and tell me all your news.",
            f"Your friend, {writer}",
        ]
    )


def _weather(rng: random.Random) -> str:
    start = rng.randrange(len(DAYS))
    lines = [f"Weather notes from {rng.choice(PLACES)}."]
    for k in range(rng.randint(3, 6)):
        day = DAYS[(start + k) % len(DAYS)]
        weather = rng.choice(WEATHER)
        degrees = rng.randint(2, 28)
        lines.append(f"On {day} it was {weather} and {degrees} degrees.")
    lines.append(f"The best day of the week was {DAYS[(start + rng.randrange(3)) % len(DAYS)]}.")
    return "\n".join(lines)


def _counting(rng: random.Random) -> str:
    kind, place = rng.choice(KINDS), rng.choice(PLACES)
    top = rng.randint(4, 10)
    lines = [f"A counting song about the {kind}s of {place}."]
    for k in range(top):
        word = NUMBERS[k]
        noun = kind if k == 0 else f"{kind}s"
        lines.append(f"{word.capitalize()} little {noun} went out to play, {word} little {noun} came home today.")
    lines.append(f"And that is how we count to {NUMBERS[top - 1]}.")
    return "\n".join(lines)


def generate(seed: int = SEED, num_documents: int = NUM_DOCUMENTS) -> str:
    """The corpus text: ``num_documents`` documents, each ended by a newline, separated by blank lines."""
    rng = random.Random(seed)
    makers = [_story] * 5 + [_letter] * 2 + [_weather, _counting]
    documents = [rng.choice(makers)(rng) for _ in range(num_documents)]
    return "\n\n".join(documents) + "\n"


def main() -> int:
    text = generate()
    CORPUS_PATH.write_text(text, encoding="utf-8")
    print(f"wrote {CORPUS_PATH} ({len(text.encode('utf-8'))} bytes, {NUM_DOCUMENTS} documents)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
