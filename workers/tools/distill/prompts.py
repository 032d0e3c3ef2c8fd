"""The prompt sets distillation asks the target to answer.

`train` and `heldout` are templated chat requests of the same kinds:
- everyday tasks people bring to a small chat model (explain, list, advise, write, small
  arithmetic);
- code: write a function in Python and other languages, explain or fix a given snippet;
- input-grounded tasks whose answer reuses text given in the prompt (summarize, rewrite,
  translate, extract, answer from a passage, fix grammar);
- requests in French, Spanish and German;
- long answers (essays, step-by-step guides, long stories), answered up to a longer limit;
- two-turn conversations: a request, the target's own answer, then a follow-up.
Fillers come in two disjoint pools: `train` requests are built from one, `heldout` from
the other, so held-out agreement measures topics, passages and snippets the draft never saw.

`unlike` is a fixed list of prompt *kinds* no template asks for (riddles, role-play,
classification, extraction, trivia, definitions, ...): agreement on it measures how far the
draft carries beyond what it was trained on.

Every list is fixed and every draw is seeded: the same (split, seed) always gives the same
requests in the same order.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass

VERSION = 2  # bump when the requests change: cached distillation data records it

# (train pool, held-out pool) for every filler slot, packed several to a line
# fmt: off
TOPICS = (
    [
        "volcanoes", "photosynthesis", "the water cycle", "black holes", "the Roman Empire",
        "the printing press", "electric cars", "vaccines", "coral reefs", "the stock market",
        "machine learning", "the human heart", "earthquakes", "solar panels", "honey bees",
        "the French Revolution", "recycling", "the internet", "climate change", "dinosaurs",
        "the moon landing", "antibiotics", "rainbows", "the immune system", "democracy",
        "the Great Wall of China", "compound interest", "jazz music", "the Olympic Games",
        "tides", "blockchain", "the Renaissance", "plate tectonics", "the periodic table",
        "wind turbines", "sleep", "the Amazon rainforest", "inflation", "DNA", "gravity",
        "the Industrial Revolution", "coffee", "chess", "the Silk Road", "glaciers",
        "nuclear power", "meditation", "the ancient Egyptians", "cloud computing", "bread",
        "the solar system", "electricity", "migration of birds", "social media", "deserts",
        "the Cold War", "batteries", "origami", "volleyball", "the human brain",
    ],
    [
        "hurricanes", "the Byzantine Empire", "octopuses", "microwave ovens", "tea",
        "the Apollo program", "opera", "rivers", "3D printing", "the Maya civilization",
        "magnets", "yoga", "penguins", "public libraries", "bicycles", "cheese",
    ],
)
ACTIVITIES = (
    [
        "learning a new language", "saving money", "running a marathon", "studying for exams",
        "starting a vegetable garden", "cooking for a large family", "working from home",
        "public speaking", "making new friends", "traveling on a budget", "learning to code",
        "keeping a houseplant alive", "writing a novel", "getting better sleep",
        "organizing a small kitchen", "training a puppy", "preparing for a job interview",
        "reducing stress", "staying focused", "learning to swim", "moving to a new city",
        "taking better photos", "eating healthier", "planning a wedding",
    ],
    [
        "learning to play the guitar", "camping in the rain", "managing a small team",
        "painting a room", "hosting a dinner party", "starting a podcast",
    ],
)
PEOPLE = (
    [
        "a robot", "a young wizard", "a lonely lighthouse keeper", "a curious cat",
        "an old fisherman", "a detective", "a little dragon", "a space explorer",
        "a baker", "a shy student", "a talking tree", "a retired pilot",
    ],
    ["a clockmaker", "a nervous knight", "a street musician", "a friendly ghost"],
)
EVENTS = (
    [
        "learns to paint", "finds a hidden door", "loses their memory", "wins a contest",
        "discovers a new planet", "makes an unlikely friend", "gets lost in a city",
        "has to save a village", "finds a map in a bottle", "learns to fly",
    ],
    ["builds a tiny boat", "meets their future self", "opens a bakery"],
)
CODE_TASKS = (
    [
        "checks whether a number is prime", "reverses a string", "counts the vowels in a word",
        "returns the largest number in a list", "computes the factorial of n",
        "merges two sorted lists", "checks whether a word is a palindrome",
        "returns the n-th Fibonacci number", "removes duplicates from a list",
        "converts Celsius to Fahrenheit", "counts how often each word appears in a text",
        "sorts a list of dictionaries by a key", "flattens a nested list",
        "finds the second smallest number in a list", "reads a file and counts its lines",
        "checks whether two strings are anagrams", "computes the average of a list",
        "returns the common elements of two lists", "capitalizes every word in a sentence",
        "checks whether a year is a leap year",
    ],
    [
        "computes the greatest common divisor of two numbers",
        "returns every even number in a list", "checks whether a list is sorted",
        "converts a binary string to an integer",
    ],
)
SUBJECTS = (
    [
        "a delayed project", "a team lunch on Friday", "a broken printer",
        "a new office policy", "a missed deadline", "a thank-you for their help",
        "a meeting next week", "a refund for a damaged order",
    ],
    ["a change of address", "a volunteer event", "a late payment"],
)
RECIPIENTS = (
    ["my manager", "a customer", "my landlord", "a colleague", "my teacher", "a neighbor"],
    ["my team", "a supplier"],
)
PRODUCTS = (
    [
        "a stainless steel water bottle", "a pair of running shoes", "a desk lamp",
        "a wireless keyboard", "a cookbook for beginners", "a wooden chess set",
    ],
    ["a travel backpack", "a smart thermostat"],
)
# fmt: on
PASSAGES = (
    [
        "The old lighthouse on the northern cape was built in 1874. For almost a century a "
        "keeper lived in the small house beside it and lit the lamp every evening. In 1969 "
        "the light was automated, and today the house is a museum that opens every summer.",
        "Maria opened her bakery in a quiet street in 2015. At first she sold only bread, "
        "but customers kept asking for cakes, so she hired a pastry chef. Now the shop "
        "employs eight people and sells out of croissants by ten every morning.",
        "Honey bees communicate through a dance. When a bee finds flowers, it returns to the "
        "hive and moves in a figure-eight pattern. The angle of the dance shows the direction "
        "of the flowers, and its length shows how far away they are.",
        "The city council voted on Tuesday to build a new bicycle lane along the river. The "
        "lane will be four kilometers long and is expected to open next spring. Supporters "
        "say it will reduce traffic, while some shop owners worry about losing parking.",
        "Our team meets every Monday at nine to review the open tickets. Each engineer "
        "reports what they finished, what they plan next, and anything that blocks them. "
        "The meeting ends when every ticket has an owner and a due date.",
        "To make a simple tomato soup, cook a chopped onion in olive oil until soft. Add "
        "garlic, two cans of tomatoes and a cup of stock, then simmer for twenty minutes. "
        "Blend the soup until smooth and season it with salt and pepper.",
        "Penicillin was discovered by Alexander Fleming in 1928. He noticed that a mold had "
        "killed the bacteria growing in one of his dishes. It took more than ten years "
        "before the drug could be produced in large amounts during the Second World War.",
        "The library will be closed from the first to the fifteenth of August while new "
        "shelves are installed. Books can still be returned through the drop box by the "
        "main door, and all due dates during the closure will be extended by two weeks.",
        "Tom wanted to run a marathon, but he had never run more than five kilometers. He "
        "followed a sixteen-week plan, running four times a week and adding a little "
        "distance every Sunday. He finished his first marathon in four hours and ten minutes.",
        "Glaciers form where more snow falls in winter than melts in summer. Over many years "
        "the snow is pressed into ice, which slowly flows downhill under its own weight. "
        "Many glaciers around the world are now shrinking because of warmer temperatures.",
        "The new phone has a larger screen, a faster processor and a battery that lasts two "
        "days. It costs one hundred dollars more than last year's model. Reviewers praised "
        "the camera but said the device is heavy and gets warm when charging.",
        "In the village of Alden, the annual harvest festival takes place on the last "
        "Saturday of September. Farmers bring their best pumpkins, children paint faces, and "
        "in the evening everyone gathers in the square to dance to live folk music.",
    ],
    [
        "The museum's new exhibit shows tools used by sailors in the eighteenth century. "
        "Visitors can try to tie the knots themselves and read letters that sailors wrote "
        "home. The exhibit runs until March and entry is free on Sundays.",
        "Anna started learning the piano at the age of forty. She practiced for twenty "
        "minutes every morning before work. After two years she played her first concert "
        "for friends, and she says it was the most nervous she has ever felt.",
        "Sea otters use rocks as tools to open shells. They float on their backs, place a "
        "rock on their chest and strike the shell against it. Some otters keep a favorite "
        "rock in a pouch of loose skin under their arm.",
    ],
)
# fmt: off
CODE_SNIPPETS = (
    [
        "def total(items):\n    sum = 0\n    for i in range(1, len(items)):\n"
        "        sum += items[i]\n    return sum\n",
        "function isEven(n) {\n  if (n % 2 = 0) {\n    return true;\n  }\n  return false;\n}\n",
        "def find(names, target):\n    for i, name in enumerate(names):\n"
        "        if name == target:\n            return i\n    return -1\n",
        "SELECT name, COUNT(*)\nFROM orders\nWHERE total > 100\nGROUP BY name\n"
        "ORDER BY COUNT(*) DESC;\n",
        "for f in *.txt; do\n  wc -l \"$f\"\ndone\n",
        "def greet(name):\n    print('Hello, ' + name)\n    return\n\ngreet(42)\n",
        "numbers = [3, 1, 2]\nnumbers = numbers.sort()\nprint(numbers[0])\n",
        "class Counter:\n    def __init__(self):\n        self.count = 0\n\n"
        "    def add(self):\n        count += 1\n",
    ],
    [
        "def last(items):\n    return items[len(items)]\n",
        "const doubled = [1, 2, 3].map(x => { x * 2 });\nconsole.log(doubled);\n",
        "def average(a, b):\n    return a + b / 2\n",
    ],
)
LANGUAGES = (
    ["JavaScript", "SQL", "Bash", "Java", "C", "Rust"],
    ["Go", "TypeScript"],
)
FOREIGN_TOPICS = (  # (French, Spanish, German) per filler
    [
        ("les volcans", "los volcanes", "Vulkane"), ("le sommeil", "el sueño", "den Schlaf"),
        ("les abeilles", "las abejas", "Bienen"), ("la pluie", "la lluvia", "den Regen"),
        ("le café", "el café", "Kaffee"), ("les vaccins", "las vacunas", "Impfstoffe"),
        ("la lune", "la luna", "den Mond"), ("le recyclage", "el reciclaje", "Recycling"),
        ("les océans", "los océanos", "die Ozeane"), ("internet", "internet", "das Internet"),
    ],
    [("les forêts", "los bosques", "Wälder"), ("le chocolat", "el chocolate", "Schokolade")],
)
# fmt: on
QUESTIONS = [  # asked about any passage
    "What happened first?",
    "What is the main point of the text?",
    "Which numbers are mentioned, and what do they describe?",
]
SENTENCES = (
    [
        "me and him goes to the store yesterday and buyed three apple.",
        "she dont like when peoples is late to the meetings.",
        "their going to there house after the game, but its raining.",
        "I has finished my homework but I forgets to bring it.",
        "the cat sleep on the sofa every days and never go outside.",
        "we was very happy when we seen the results of the test.",
    ],
    ["he runned to the bus but it leaved without him.", "they is the best team in the league."],
)

NUMBERS = (((12, 99), (2, 11)), ((100, 999), (12, 19)))  # (a, b) ranges of each split
TARGET_LANGUAGES = ["French", "Spanish", "German"]

TEMPLATES = [
    "Explain {topic} in simple terms.",
    "What is {topic}?",
    "How does {topic} work?",
    "Why is {topic} important?",
    "Give me a short overview of {topic}.",
    "List five interesting facts about {topic}.",
    "What are the pros and cons of {topic}?",
    "Explain {topic} to a ten-year-old.",
    "Write a short paragraph about the history of {topic}.",
    "What are the most common misconceptions about {topic}?",
    "Give me three tips for {activity}.",
    "How should a beginner start {activity}?",
    "What are common mistakes people make when {activity}?",
    "Make a one-week plan for {activity}.",
    "Write a short poem about {topic}.",
    "Write a haiku about {topic}.",
    "Write a short story about {person} who {event}.",
    "Write the opening paragraph of a novel about {person} who {event}.",
    "Write an email to {recipient} about {subject}.",
    "Write a short, polite message to {recipient} about {subject}.",
    "Write a product description for {product}.",
    "Write a Python function that {code_task}.",
    "Write a Python function that {code_task}, with comments.",
    "How would you write a program that {code_task}? Explain the steps.",
    "Write a {language} function that {code_task}.",
    "Explain what this code does:\n\n{snippet}",
    "Find and fix the bug in this code:\n\n{snippet}",
    "Add comments to this code:\n\n{snippet}",
    "What is {a} plus {b}? Show your work.",
    "If I have {a} apples and give away {b}, how many are left?",
    "What is {a} times {b}?",
    "Summarize the following text in two sentences:\n\n{passage}",
    "Summarize this text in one sentence:\n\n{passage}",
    "Rewrite the following text in a more formal tone:\n\n{passage}",
    "Rewrite this text so that a child can understand it:\n\n{passage}",
    "Rewrite this text in the first person:\n\n{passage}",
    "List the key points of this text as bullet points:\n\n{passage}",
    "Repeat this text exactly, but replace the word 'the' with 'a':\n\n{passage}",
    "Read the text and answer the question.\n\nText: {passage}\n\nQuestion: {question}",
    "Give this text a short title:\n\n{passage}",
    "Translate this text into {target_language}:\n\n{passage}",
    "Write three questions a teacher could ask about this text:\n\n{passage}",
    "Correct the grammar of this sentence: {sentence}",
    "Fix the spelling and grammar: {sentence}",
    "Explique {fr_topic} en termes simples.",
    "Donne-moi trois faits intéressants sur {fr_topic}.",
    "Explica {es_topic} de forma sencilla.",
    "Escribe un párrafo corto sobre {es_topic}.",
    "Erkläre {de_topic} in einfachen Worten.",
    "Nenne drei interessante Fakten über {de_topic}.",
]
LONG_TEMPLATES = [  # answered up to the longer limit
    "Write a detailed essay of several paragraphs about {topic}.",
    "Write a step-by-step guide to {activity}, with at least eight steps.",
    "Write a long story about {person} who {event}.",
    "Explain {topic} in depth: its history, how it works, and why it matters today.",
]
FOLLOW_UPS = [  # the second turn of a two-turn conversation
    "Can you make that shorter?",
    "Now explain it as if I were five years old.",
    "Can you give me an example?",
    "Thanks! Can you add two more points?",
    "Rewrite your answer as a bullet list.",
    "Translate your answer into French.",
    "Why is that?",
    "Can you say more about the first point?",
]
TWO_TURN_SHARE = 0.2  # of the requests built from TEMPLATES

UNLIKE = [  # kinds no template above asks for
    "Tell me a joke about computers.",
    "What has keys but can't open locks? Explain the riddle.",
    "Pretend you are a tour guide in Paris and greet a group of tourists.",
    "Suggest five names for a new coffee shop.",
    "Is this review positive or negative? 'The food was cold and the waiter ignored us.'",
    "Extract the name, age and city from this sentence as JSON: 'Lena is 34 and lives in Berlin.'",
    "Who painted the Mona Lisa?",
    "Which city is the capital of Australia?",
    "What does the word 'serendipity' mean? Use it in a sentence.",
    "My friend forgot my birthday. What should I say to them?",
    "A train travels at 60 kilometers per hour. How far does it go in two and a half hours?",
    "How many centimeters are in five feet?",
    "Write a dialogue between a customer and a waiter in a busy restaurant.",
    "Write a slogan for a campaign that asks people to drink more water.",
    "What questions might I be asked in an interview for a nursing job?",
    "Describe the taste of a lemon to someone who has never eaten one.",
    "What would happen if the moon disappeared?",
    "Give me ten words that rhyme with 'light'.",
    "How do weather and climate differ?",
    "Create a multiple-choice quiz question about the planets, with the answer.",
    "Write a tweet announcing the opening of a new bakery.",
    "Which is a better first pet for a family, a cat or a dog?",
    "Sort these animals from smallest to largest: horse, mouse, elephant, cat.",
    "I have eggs, spinach and cheese. What can I cook for dinner?",
    "Convert 3:45 pm to 24-hour time.",
    "Name three famous scientists and what each is known for.",
    "Describe a sunset over the ocean using all five senses.",
    "Tell me the plural of 'cactus'.",
    "Act as a personal trainer and motivate me to exercise today.",
    "What are some fun things to do on a rainy Sunday?",
    "Classify these foods as fruit or vegetable: tomato, carrot, apple, broccoli.",
    "Summarize the plot of Romeo and Juliet.",
    "Why is the sky blue?",
    "Write a thank-you note to a nurse who cared for my grandmother.",
    "If you could have any superpower, which would you choose and why?",
    "Give me a packing list for a beach holiday.",
    "How do I tell if an egg is fresh?",
    "Spell the word 'necessary' backwards.",
    "Help me remember the order of the planets.",
    "Compare trains and planes for a 500-kilometer trip.",
]

_SLOTS = {
    "topic": TOPICS,
    "activity": ACTIVITIES,
    "person": PEOPLE,
    "event": EVENTS,
    "code_task": CODE_TASKS,
    "language": LANGUAGES,
    "snippet": CODE_SNIPPETS,
    "subject": SUBJECTS,
    "recipient": RECIPIENTS,
    "product": PRODUCTS,
    "passage": PASSAGES,
    "sentence": SENTENCES,
}
SPLITS = ("train", "heldout", "unlike")


@dataclass(frozen=True)
class Request:
    """A conversation to ask the target: its user turns, each answered before the next."""

    turns: tuple[str, ...]
    long: bool = False  # the first answer may run to the longer limit


def requests(split: str, seed: int) -> Iterator[Request]:
    """Distinct requests of one split, in a seeded order, until the combinations run out.

    `train` and `heldout`: each draw picks a template uniformly (long ones included), then
    fills its slots from the split's pools, so kinds stay balanced however many requests
    are taken; a share of the short ones gets a follow-up turn. `unlike`: its fixed list.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    rng = random.Random(f"{split}:{seed}")
    if split == "unlike":
        yield from (Request((text,)) for text in rng.sample(UNLIKE, len(UNLIKE)))
        return
    pool = SPLITS.index(split)
    seen: set[Request] = set()
    misses = 0
    while misses < 1000:  # a long run of repeats: (nearly) every combination is out
        request = _draw(rng, pool)
        if request in seen:
            misses += 1
            continue
        misses = 0
        seen.add(request)
        yield request


def _draw(rng: random.Random, pool: int) -> Request:
    template = rng.choice(TEMPLATES + LONG_TEMPLATES)
    fill = {name: rng.choice(lists[pool]) for name, lists in _SLOTS.items()}
    fill["fr_topic"], fill["es_topic"], fill["de_topic"] = rng.choice(FOREIGN_TOPICS[pool])
    fill["question"] = rng.choice(QUESTIONS)
    fill["target_language"] = rng.choice(TARGET_LANGUAGES)
    fill["a"], fill["b"] = rng.randint(*NUMBERS[pool][0]), rng.randint(*NUMBERS[pool][1])
    text = template.format(**fill)
    if template in LONG_TEMPLATES:
        return Request((text,), long=True)
    if rng.random() < TWO_TURN_SHARE:
        return Request((text, rng.choice(FOLLOW_UPS)))
    return Request((text,))


def take(split: str, seed: int, n: int) -> list[str]:
    """The user messages of the first n one-turn requests of `requests(split, seed)`."""
    single = (r.turns[0] for r in requests(split, seed) if len(r.turns) == 1)
    return list(itertools.islice(single, n))
