"""The prompt set distillation asks the target to answer: templated chat requests.

Templates cover the tasks people bring to a small chat model (explain, list, advise,
write, code, small arithmetic) and input-grounded tasks whose answer reuses text
given in the prompt (summarize, rewrite, answer from a passage, fix grammar).
Fillers come in two disjoint pools: `train` prompts are built from one, `heldout`
prompts from the other, so held-out agreement measures topics and passages the
draft never saw. Every list is fixed and every draw is seeded: the same
(split, seed) always gives the same prompts in the same order.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

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
    "What is {a} plus {b}? Show your work.",
    "If I have {a} apples and give away {b}, how many are left?",
    "What is {a} times {b}?",
    "Summarize the following text in two sentences:\n\n{passage}",
    "Summarize this text in one sentence:\n\n{passage}",
    "Rewrite the following text in a more formal tone:\n\n{passage}",
    "List the key points of this text as bullet points:\n\n{passage}",
    "Repeat this text exactly, but replace the word 'the' with 'a':\n\n{passage}",
    "Read the text and answer the question.\n\nText: {passage}\n\nQuestion: {question}",
    "Give this text a short title:\n\n{passage}",
    "Correct the grammar of this sentence: {sentence}",
    "Fix the spelling and grammar: {sentence}",
]

_SLOTS = {
    "topic": TOPICS,
    "activity": ACTIVITIES,
    "person": PEOPLE,
    "event": EVENTS,
    "code_task": CODE_TASKS,
    "subject": SUBJECTS,
    "recipient": RECIPIENTS,
    "product": PRODUCTS,
    "passage": PASSAGES,
    "sentence": SENTENCES,
}
SPLITS = ("train", "heldout")


def prompts(split: str, seed: int) -> Iterator[str]:
    """Distinct user messages of one split, in a seeded order, until the combinations run out.

    Each draw picks a template uniformly, then fills its slots from the split's pools, so
    tasks stay balanced however many prompts are taken.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    pool = SPLITS.index(split)
    rng = random.Random(f"{split}:{seed}")
    seen: set[str] = set()
    misses = 0
    while misses < 1000:  # a long run of repeats: (nearly) every combination is out
        template = rng.choice(TEMPLATES)
        fill = {name: rng.choice(lists[pool]) for name, lists in _SLOTS.items()}
        fill["question"] = rng.choice(QUESTIONS)
        fill["a"], fill["b"] = rng.randint(12, 99), rng.randint(2, 11)
        text = template.format(**fill)
        if text in seen:
            misses += 1
            continue
        misses = 0
        seen.add(text)
        yield text


def take(split: str, seed: int, n: int) -> list[str]:
    """The first n prompts of `prompts(split, seed)`."""
    return list(itertools.islice(prompts(split, seed), n))
