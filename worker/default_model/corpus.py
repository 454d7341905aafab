"""Synthetic training text for the embedded default model.

The default model must be built on a fresh machine with no download, so its text is
generated here from templates with a seeded `random.Random`: the same seed gives the
same corpus, byte for byte, on every machine and Python version (no hash-ordered
containers, no text read from the installed environment).

The text is deliberately narrow (greetings, simple facts, short stories, plain
sentences): a model of about a million parameters trained for minutes on a CPU can learn
narrow text well enough to answer in readable English and to stop with EOS, and the
point of this model is to exercise the serving engine, not to know things.

A document is either plain text or a dialogue, a list of (role, content) turns that
the build renders with the tokenizer's chat template.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Document:
    """One training document: `text` when plain, `turns` when a dialogue."""

    text: str | None = None
    turns: tuple[tuple[str, str], ...] | None = None


MODEL_NAME = "kvserve-tiny"

SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a friendly assistant. Answer briefly.",
    "You are kvserve-tiny, a small helpful model.",
    "Answer the question in one sentence.",
)

GREETINGS = ("Hello!", "Hi!", "Hi there.", "Hello.", "Good morning!", "Good evening!", "Hey!")
GREETING_REPLIES = (
    "Hello! How can I help you today?",
    "Hi! What can I do for you?",
    "Hello! I am happy to help. What would you like to know?",
    "Hi there! Ask me a question and I will do my best.",
)

IDENTITY_QUESTIONS = ("Who are you?", "What is your name?", "What are you?", "Tell me about yourself.")
IDENTITY_REPLIES = (
    "I am kvserve-tiny, a small language model that runs offline.",
    "My name is kvserve-tiny. I am a very small model made for testing a server.",
    "I am a tiny assistant. I know a few simple facts and short stories.",
)

THANKS = ("Thank you!", "Thanks.", "Thanks a lot!", "Great, thank you.")
THANKS_REPLIES = ("You are welcome!", "Happy to help!", "You are welcome. Have a nice day!")

FAREWELLS = ("Goodbye!", "Bye.", "See you later!", "Good night!")
FAREWELL_REPLIES = ("Goodbye! Have a nice day.", "Bye! Take care.", "See you soon!")

CAPITALS = (
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
    ("Japan", "Tokyo"), ("China", "Beijing"), ("India", "New Delhi"), ("Egypt", "Cairo"),
    ("Canada", "Ottawa"), ("Brazil", "Brasilia"), ("Mexico", "Mexico City"),
    ("Russia", "Moscow"), ("Greece", "Athens"), ("Portugal", "Lisbon"), ("Norway", "Oslo"),
    ("Sweden", "Stockholm"), ("Poland", "Warsaw"), ("Kenya", "Nairobi"), ("Peru", "Lima"),
    ("Australia", "Canberra"), ("Ireland", "Dublin"), ("Austria", "Vienna"),
    ("Turkey", "Ankara"), ("Argentina", "Buenos Aires"), ("Chile", "Santiago"),
    ("Finland", "Helsinki"), ("Denmark", "Copenhagen"), ("Thailand", "Bangkok"),
)

COLORS = (
    ("the sky", "blue"), ("grass", "green"), ("snow", "white"), ("a banana", "yellow"),
    ("a tomato", "red"), ("coal", "black"), ("an orange", "orange"), ("the sun", "yellow"),
    ("milk", "white"), ("a leaf", "green"), ("a strawberry", "red"), ("the sea", "blue"),
    ("chocolate", "brown"), ("a lemon", "yellow"), ("a cloud", "white"), ("a carrot", "orange"),
)

ANIMAL_SOUNDS = (
    ("dog", "woof"), ("cat", "meow"), ("cow", "moo"), ("duck", "quack"), ("sheep", "baa"),
    ("lion", "roar"), ("owl", "hoot"), ("horse", "neigh"), ("pig", "oink"), ("frog", "croak"),
    ("bee", "buzz"), ("mouse", "squeak"),
)

LEGS = (
    ("a spider", "eight"), ("a dog", "four"), ("a bird", "two"), ("an ant", "six"),
    ("a cat", "four"), ("a horse", "four"), ("a chicken", "two"), ("a bee", "six"),
    ("a fish", "no"), ("a snake", "no"), ("a person", "two"), ("a cow", "four"),
)

OPPOSITES = (
    ("hot", "cold"), ("big", "small"), ("up", "down"), ("fast", "slow"), ("day", "night"),
    ("happy", "sad"), ("old", "new"), ("open", "closed"), ("light", "dark"), ("left", "right"),
    ("wet", "dry"), ("early", "late"), ("full", "empty"), ("loud", "quiet"), ("hard", "soft"),
    ("top", "bottom"), ("in", "out"), ("yes", "no"), ("near", "far"), ("rich", "poor"),
)

DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
MONTHS = (
    "January", "February", "March", "April", "May", "June", "July", "August",
    "September", "October", "November", "December",
)
NUMBER_WORDS = (
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen",
    "eighteen", "nineteen", "twenty",
)

# Things the model is asked about but does not know: it learns a polite, readable
# fallback, so that an arbitrary prompt still gets a sentence and EOS.
UNKNOWN_TOPICS = (
    "quantum physics", "the stock market", "machine learning", "ancient history",
    "the weather tomorrow", "black holes", "the meaning of life", "cooking pasta",
    "the moon landing", "computer networks", "music theory", "the human brain",
    "chess openings", "climate change", "the Roman empire", "volcanoes", "electric cars",
    "the ocean floor", "gardening", "painting", "databases", "the internet", "poetry",
    "football", "mountains", "robots", "space travel", "dinosaurs", "money", "sleep",
)
UNKNOWN_QUESTION_TEMPLATES = (
    "What is {t}?", "Can you explain {t}?", "Tell me about {t}.", "What do you know about {t}?",
    "How does {t} work?", "Why is {t} important?", "Write an essay about {t}.",
)
UNKNOWN_REPLY_TEMPLATES = (
    "I am a very small model, so I do not know much about {t}. You could ask a bigger model.",
    "That is a good question about {t}, but I only know a few simple facts.",
    "I am sorry, I cannot explain {t} well. I am a tiny model.",
)

NAMES = (
    "Anna", "Ben", "Clara", "David", "Emma", "Finn", "Grace", "Hugo", "Ivy", "Jack", "Lena",
    "Max", "Nora", "Oscar", "Pia", "Sam", "Tom", "Zoe", "Mia", "Leo",
)
ANIMALS = (
    "cat", "dog", "rabbit", "fox", "bear", "mouse", "bird", "horse", "duck", "turtle",
    "owl", "frog", "lion", "goat", "pig", "squirrel",
)
ADJECTIVES = (
    "little", "big", "happy", "sleepy", "brave", "small", "curious", "kind", "quiet",
    "clever", "funny", "old", "young", "friendly", "shy", "busy",
)
PLACES = (
    "in the forest", "by the river", "in a small village", "on a farm", "in the garden",
    "near the sea", "in the park", "on a hill", "in a big city", "at the lake",
)
ITEMS = (
    "a red ball", "a shiny stone", "an old map", "a blue kite", "a tiny key", "a warm hat",
    "a yellow flower", "a wooden box", "a lost shoe", "a green apple",
)
ACTIONS = (
    "went for a walk", "looked for food", "played with a friend", "sang a song",
    "read a book", "climbed a tree", "ate an apple", "took a nap", "drew a picture",
    "built a small house", "went to the market", "planted a seed",
)
FEELINGS = ("happy", "glad", "proud", "calm", "excited", "tired but happy")
FOODS = ("bread", "soup", "apples", "rice", "cheese", "carrots", "pancakes", "berries")
WEATHER = ("sunny", "rainy", "windy", "cold", "warm", "cloudy", "snowy")


def _a(word: str) -> str:
    """`word` with its indefinite article ("a cat", "an owl")."""
    return f"{'an' if word[0] in 'aeiou' else 'a'} {word}"


def _dialogue(rng: random.Random, user: str, reply: str) -> Document:
    """A one-turn dialogue, sometimes preceded by a system prompt."""
    turns: list[tuple[str, str]] = []
    if rng.random() < 0.3:
        turns.append(("system", rng.choice(SYSTEM_PROMPTS)))
    turns.append(("user", user))
    turns.append(("assistant", reply))
    return Document(turns=tuple(turns))


def _fact_pair(rng: random.Random) -> tuple[str, str]:
    """One question and its answer, drawn from the fact tables."""
    kind = rng.randrange(9)
    if kind == 0:
        country, city = rng.choice(CAPITALS)
        question = rng.choice(
            (f"What is the capital of {country}?", f"Which city is the capital of {country}?")
        )
        return question, f"The capital of {country} is {city}."
    if kind == 1:
        thing, color = rng.choice(COLORS)
        return f"What color is {thing}?", f"{thing[0].upper()}{thing[1:]} is {color}."
    if kind == 2:
        animal, sound = rng.choice(ANIMAL_SOUNDS)
        return (
            rng.choice((f"What does {_a(animal)} say?", f"What sound does {_a(animal)} make?")),
            f"{_a(animal).capitalize()} says {sound}.",
        )
    if kind == 3:
        thing, count = rng.choice(LEGS)
        return f"How many legs does {thing} have?", f"{thing[0].upper()}{thing[1:]} has {count} legs."
    if kind == 4:
        word, opposite = rng.choice(OPPOSITES)
        if rng.random() < 0.5:
            word, opposite = opposite, word
        return f"What is the opposite of {word}?", f"The opposite of {word} is {opposite}."
    if kind == 5:
        index = rng.randrange(len(DAYS))
        day, following = DAYS[index], DAYS[(index + 1) % len(DAYS)]
        return f"What day comes after {day}?", f"{following} comes after {day}."
    if kind == 6:
        index = rng.randrange(len(MONTHS))
        month, following = MONTHS[index], MONTHS[(index + 1) % len(MONTHS)]
        return f"Which month comes after {month}?", f"{following} comes after {month}."
    if kind == 7:
        left, right = rng.randrange(11), rng.randrange(10)
        return (
            f"What is {left} plus {right}?",
            f"{left} plus {right} is {left + right}.",
        )
    left, right = rng.randrange(1, 11), rng.randrange(1, 11)
    return (
        f"How much is {NUMBER_WORDS[left]} and {NUMBER_WORDS[right]}?",
        f"{NUMBER_WORDS[left].capitalize()} and {NUMBER_WORDS[right]} make {NUMBER_WORDS[left + right]}.",
    )


def _story(rng: random.Random, animal: str | None = None) -> str:
    """A three to five sentence story, readable on its own."""
    animal = animal or rng.choice(ANIMALS)
    name = rng.choice(NAMES)
    adjective = rng.choice(ADJECTIVES)
    sentences = [
        f"Once upon a time, there was {_a(adjective)} {animal} named {name}.",
        f"{name} lived {rng.choice(PLACES)}.",
        f"One {rng.choice(WEATHER)} day, {name} {rng.choice(ACTIONS)} and found {rng.choice(ITEMS)}.",
    ]
    if rng.random() < 0.5:
        sentences.append(f"{name} shared some {rng.choice(FOODS)} with {_a(rng.choice(ANIMALS))}.")
    sentences.append(f"In the end, {name} felt {rng.choice(FEELINGS)}.")
    return " ".join(sentences)


def _plain_sentences(rng: random.Random) -> str:
    """Two to four simple sentences, for plain (non-chat) completion."""
    sentences: list[str] = []
    for _ in range(rng.randint(2, 4)):
        kind = rng.randrange(4)
        if kind == 0:
            sentences.append(
                f"The {rng.choice(ADJECTIVES)} {rng.choice(ANIMALS)} {rng.choice(ACTIONS)} {rng.choice(PLACES)}."
            )
        elif kind == 1:
            sentences.append(f"{rng.choice(NAMES)} likes to eat {rng.choice(FOODS)}.")
        elif kind == 2:
            sentences.append(f"Today the weather is {rng.choice(WEATHER)}.")
        else:
            sentences.append(f"{rng.choice(NAMES)} {rng.choice(ACTIONS)} with {rng.choice(NAMES)}.")
    return " ".join(sentences)


def generate_corpus(num_documents: int, seed: int) -> list[Document]:
    """`num_documents` documents, the same list for the same arguments."""
    rng = random.Random(seed)
    documents: list[Document] = []
    for _ in range(num_documents):
        kind = rng.random()
        if kind < 0.08:
            documents.append(_dialogue(rng, rng.choice(GREETINGS), rng.choice(GREETING_REPLIES)))
        elif kind < 0.13:
            documents.append(_dialogue(rng, rng.choice(IDENTITY_QUESTIONS), rng.choice(IDENTITY_REPLIES)))
        elif kind < 0.45:
            documents.append(_dialogue(rng, *_fact_pair(rng)))
        elif kind < 0.52:
            topic = rng.choice(UNKNOWN_TOPICS)
            documents.append(
                _dialogue(
                    rng,
                    rng.choice(UNKNOWN_QUESTION_TEMPLATES).format(t=topic),
                    rng.choice(UNKNOWN_REPLY_TEMPLATES).format(t=topic),
                )
            )
        elif kind < 0.66:
            animal = rng.choice(ANIMALS)
            request = rng.choice(
                (
                    "Tell me a story.",
                    "Tell me a short story.",
                    f"Tell me a story about {_a(animal)}.",
                    f"Write a short story about {_a(animal)}.",
                )
            )
            documents.append(_dialogue(rng, request, _story(rng, animal if "about" in request else None)))
        elif kind < 0.74:
            # Two turns: the model sees a finished assistant turn followed by more chat,
            # so it learns that EOS closes a turn, not only a document.
            first_question, first_answer = _fact_pair(rng)
            second_question, second_answer = _fact_pair(rng)
            turns = (
                ("user", first_question),
                ("assistant", first_answer),
                ("user", rng.choice((second_question, rng.choice(THANKS), rng.choice(FAREWELLS)))),
            )
            last = turns[-1][1]
            reply = (
                second_answer
                if last == second_question
                else rng.choice(THANKS_REPLIES if last in THANKS else FAREWELL_REPLIES)
            )
            documents.append(Document(turns=turns + (("assistant", reply),)))
        elif kind < 0.86:
            documents.append(Document(text=_story(rng)))
        else:
            documents.append(Document(text=_plain_sentences(rng)))
    return documents
