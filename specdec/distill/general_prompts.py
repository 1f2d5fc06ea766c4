"""General distillation prompts: everyday code, explanation, chat and translation requests.

The stdlib-derived prompts in prompts.py alone left the draft far from what users ask (and from the
benchmark's prompts): held-out agreement 0.62 on its own prompts but 0.27-0.52 on the benchmark's.
These are built from templates and vocabularies written for this purpose. None of the benchmark's or
the demo's tasks, topics or translation sentences appear here (tests/unit/test_distill.py checks the
texts; the topics were left out by hand: palindromes, Fibonacci, word counts, binary search, stacks,
Celsius, FizzBuzz, reversing words, hash tables, the internet, seasons, vaccines, Big O, inflation,
recursion, photosynthesis, sleep, birthdays, guitar, interviews, houseplants, dinners).
"""

from __future__ import annotations

import random

CODE_TASKS = (
    "checks whether a number is prime", "returns the factorial of n",
    "merges two sorted lists into one sorted list",
    "removes duplicates from a list while keeping the original order",
    "counts the vowels in a string", "finds the largest element in a list without using max",
    "computes the greatest common divisor of two integers", "flattens a nested list",
    "transposes a matrix given as a list of lists", "checks whether two strings are anagrams",
    "returns the sum of the digits of an integer", "converts a Roman numeral to an integer",
    "capitalises the first letter of every word in a string",
    "returns the second largest number in a list", "computes the average of a list of numbers",
    "sorts a list of dictionaries by a given key", "converts kilometres to miles",
    "checks whether a year is a leap year", "generates a random password of a given length",
    "finds the longest word in a sentence", "rotates a list by k positions",
    "returns the n-th triangular number", "finds the common elements of two lists",
    "computes the median of a list of numbers", "converts a decimal number to binary",
    "sorts a list with bubble sort", "sorts a list with insertion sort",
    "sorts a list with merge sort", "sorts a list with quicksort",
    "checks whether an email address looks valid using a regular expression",
    "groups a list of words by their first letter",
    "returns a dictionary with the frequency of each character in a string",
    "checks whether the brackets in a string are balanced",
    "finds all prime numbers below n with the sieve of Eratosthenes",
    "computes compound interest", "splits a list into chunks of size n",
    "merges two dictionaries, summing the values of shared keys",
    "removes all whitespace from a string", "computes the dot product of two vectors",
    "finds the index of the smallest value in a list",
    "computes the area of a circle from its radius",
    "returns the number of days between two dates", "swaps the keys and values of a dictionary",
    "checks whether a list is sorted", "returns the most common element in a list",
    "truncates a string to n characters and adds an ellipsis",
    "converts a CamelCase string to snake_case",
    "counts how many times a substring occurs in a string",
    "returns the running total of a list of numbers", "simulates rolling two dice",
    "computes the distance between two points", "computes the least common multiple of two numbers",
    "finds the missing number in a list containing 1 to n", "checks whether a number is a perfect square",
    "returns all pairs in a list that add up to a target", "computes the power of a number without **",
    "converts a list of strings to integers, skipping invalid entries",
    "returns the characters that appear in both of two strings",
    "computes the total price of a shopping cart given as a dictionary",
    "formats a number of seconds as hours, minutes and seconds",
    "reads a JSON file and returns the value of a given key",
    "writes a list of rows to a CSV file", "finds duplicate files in a folder by their size",
    "returns the first non-repeating character in a string", "computes the mode of a list",
    "checks whether a string is a valid IPv4 address", "computes the standard deviation of a list",
    "returns the k largest numbers from a list", "interleaves two lists",
    "counts the number of set bits in an integer",
)
CODE_CLASSES = (
    ("Queue", "enqueue, dequeue and size methods"),
    ("BankAccount", "deposit, withdraw and a balance property"),
    ("Rectangle", "area and perimeter methods"),
    ("LinkedList", "append, remove and find methods"),
    ("Counter", "increment, decrement and reset methods"),
    ("TodoList", "methods to add, complete and list tasks"),
    ("Point", "a method that computes the distance to another point"),
    ("Timer", "start, stop and elapsed methods"),
    ("Inventory", "methods to add items, remove items and report quantities"),
    ("Student", "a name, a list of grades and a method for the average grade"),
    ("Library", "methods to add books, lend them and return them"),
    ("Vector2D", "addition, subtraction and a length method"),
    ("Circle", "area and circumference methods"),
    ("ShoppingCart", "methods to add items, remove items and compute the total"),
    ("Matrix", "addition and multiplication methods"),
)
CODE_TEMPLATES = (
    "Write a Python function that {task}.",
    "Write a Python function that {task}.",
    "Can you write Python code that {task}?",
    "Write a short Python program that {task}.",
    "Write a JavaScript function that {task}.",
)
CLASS_TEMPLATES = (
    "Write a Python class {name} with {methods}.",
    "Implement the {name} class in Python with {methods}.",
)
CODE_SUFFIXES = ("", "", " Include a docstring.", " Add a short example of how to call it.",
                 " Use type hints.", " Explain the code briefly.", " Keep it simple.",
                 " Add comments to the code.")

EXPLAIN_CONCEPTS = (
    "a linked list", "an operating system", "machine learning", "a compiler", "encryption",
    "a database index", "cloud computing", "an API", "the greenhouse effect", "gravity",
    "the water cycle", "natural selection", "DNA", "a black hole", "electricity", "magnetism",
    "supply and demand", "interest rates", "the stock market", "a government budget deficit",
    "democracy", "the scientific method", "plate tectonics", "object-oriented programming",
    "a neural network", "version control", "a virtual machine", "the Pythagorean theorem",
    "probability", "a prime number", "a logarithm", "an ecosystem", "the food chain",
    "the French Revolution", "the Industrial Revolution", "the Renaissance", "a carbon footprint",
    "renewable energy", "nuclear fission", "an atom", "a chemical reaction", "friction",
    "a compiler error", "a memory leak", "a sorting algorithm", "a queue data structure",
    "a graph in computer science", "a pointer", "multithreading", "a REST API", "unit testing",
    "a recipe's ratio of flour to water", "compound interest", "a mortgage", "taxes",
    "the theory of relativity", "quantum computing", "an earthquake", "a hurricane", "erosion",
    "the nitrogen cycle", "antibiotics", "metabolism", "the circulatory system", "a calorie",
)
EXPLAIN_PROCESSES = (
    "a refrigerator keeps food cold", "a search engine finds web pages", "a car engine works",
    "rainbows form", "airplanes stay in the air", "the heart pumps blood",
    "a battery stores energy", "GPS finds your location", "credit cards work",
    "solar panels make electricity", "email gets delivered", "a law is made in a parliament",
    "the moon causes tides", "sound travels through the air", "the brain stores memories",
    "garbage collection works in Python", "a web browser displays a page",
    "a microwave oven heats food", "a bicycle's gears work", "clouds form",
    "a thermostat controls temperature", "bees make honey", "a public key signature works",
    "a compiler optimises code", "a touchscreen detects a finger", "a camera takes a picture",
    "yeast makes bread rise", "a bank lends money", "a volcano erupts", "a river forms a delta",
)
EXPLAIN_WHY = (
    "the sky is blue", "leaves change colour in autumn", "ice floats on water",
    "the ocean is salty", "we have time zones", "computers use binary", "metal feels colder than wood",
    "the moon has phases", "we get hiccups", "onions make people cry", "cats purr",
    "the stars twinkle", "bread goes stale", "planes leave white trails in the sky",
    "some people are left-handed", "the Dead Sea is so salty", "we yawn",
)
EXPLAIN_TEMPLATES = (
    "Explain {concept} in simple terms.",
    "What is {concept}? Explain briefly.",
    "Explain {concept} to a beginner, with an example.",
    "Can you explain what {concept} is?",
)
PROCESS_TEMPLATES = ("Explain how {process}.", "How does it work when {process}? Explain briefly.",
                     "Explain in simple terms how {process}.")
WHY_TEMPLATES = ("Why {why}? Explain briefly.", "Can you explain why {why}?",
                 "Explain why {why}.")
EXPLAIN_SUFFIXES = ("", "", "", " Keep it short.", " Use an analogy.", " Use bullet points.",
                    " Explain it to a ten-year-old.", " Answer in a few sentences.")

CHAT_REQUESTS = (
    "I get distracted easily when I work from home. Any tips?",
    "I want to start running but I have never exercised. Where should I begin?",
    "What are some good habits for saving money each month?",
    "I am moving to a new city where I know nobody. How can I make friends?",
    "Can you suggest a few board games for a family with young children?",
    "I want to learn to cook. Which simple dishes should I try first?",
    "How can I stop procrastinating on my assignments?",
    "What should I pack for a three-day hiking trip?",
    "I feel stressed before exams. What can I do?",
    "Can you recommend a routine for a productive morning?",
    "What are good ways to practise a new language every day?",
    "I want to read more books this year. How do I build the habit?",
    "What is a good way to keep my kitchen organised?",
    "My neighbour's dog barks all night. How should I talk to them about it?",
    "I have to give a presentation at work next week. How do I prepare?",
    "What are some cheap ways to decorate a small apartment?",
    "How do I keep my phone battery healthy?",
    "I want to eat less sugar. Do you have any advice?",
    "What can I do on a rainy day with two bored teenagers?",
    "How should I prepare for my first marathon?",
    "Can you suggest a simple weekly workout plan?",
    "How do I write a polite email asking for a deadline extension?",
    "What are some fun hobbies I could start this winter?",
    "I want to drink more water during the day. Any tricks?",
    "How do I choose a good pair of running shoes?",
    "I am planning a trip to Japan. What should I know before going?",
    "Can you suggest a name for my new bakery?",
    "What are easy ways to reduce plastic waste at home?",
    "How can I be a better listener?",
    "My team at work disagrees a lot. How can I help us get along?",
    "What are some healthy snacks for a long car trip?",
    "How can I learn to draw if I have no talent?",
    "What questions should I ask when viewing a flat to rent?",
    "How do I start a small herb garden on a balcony?",
    "Can you give me a plan to learn Python in a month?",
    "I keep forgetting people's names. How can I remember them?",
    "What is a good gift for a colleague who is retiring?",
    "How should I care for a goldfish?",
    "What can I do to feel less lonely in the evenings?",
    "I want to volunteer in my community. Where could I start?",
)
CHAT_TEMPLATES = (
    "Give me {n} tips for {activity}.",
    "What should I keep in mind when {situation}?",
    "Write a short {form} about {topic}.",
    "Can you help me plan {plan}?",
    "What are the pros and cons of {choice}?",
    "My friend says {claim}. Is that true?",
    "Describe {topic} to someone who has never heard of it.",
    "Suggest {n} ideas for {plan}.",
)
CHAT_FILLERS = {
    "n": ("three", "four", "five"),
    "activity": ("running a first 5k race", "keeping a tidy desk", "writing clear emails",
                 "saving money on groceries", "learning to swim", "painting with watercolours",
                 "starting a vegetable garden", "taking better phone photos", "reading more books",
                 "staying focused while studying", "hiking in hot weather", "baking bread at home",
                 "speaking in public", "organising a small library", "learning chess openings",
                 "meeting new people", "cycling to work", "making a budget", "camping with kids",
                 "working at a standing desk"),
    "situation": ("moving to a new city", "adopting a cat", "buying a used bicycle",
                  "starting a new job", "travelling alone for the first time",
                  "choosing a laptop for programming", "renting my first apartment",
                  "writing a cover letter", "training a puppy", "cooking for a large group",
                  "buying a used car", "asking for a raise", "starting a small business"),
    "form": ("poem", "story", "limerick", "dialogue", "diary entry", "product description",
             "haiku", "song verse"),
    "topic": ("the ocean at night", "a lighthouse keeper", "autumn leaves", "a robot gardener",
              "the first snow of winter", "a busy train station", "a lost umbrella",
              "an old clock tower", "volcanoes", "honeybees", "the moon landing",
              "a mountain village", "glaciers", "the printing press", "coral reefs",
              "a city market", "a friendly dragon", "a rainy afternoon"),
    "plan": ("a picnic in the park", "a family game night", "a study schedule for exams",
             "a road trip along the coast", "a surprise dinner for my parents",
             "a week of simple lunches", "a small community clean-up day",
             "a reading challenge for the summer", "a day trip to the mountains",
             "a small wedding anniversary celebration"),
    "choice": ("working from home", "electric cars", "living in a big city",
               "learning two languages at once", "renting versus buying a home",
               "using a paper notebook instead of an app", "public transport",
               "owning a dog", "freelancing", "studying abroad"),
    "claim": ("we only use ten percent of our brains", "goldfish have a three-second memory",
              "lightning never strikes the same place twice", "bats are blind",
              "the Great Wall of China is visible from space", "bulls hate the colour red",
              "cracking your knuckles causes arthritis", "carrots improve your night vision"),
}

TRANSLATION_SENTENCES = (
    "The museum is closed on Mondays.", "We are going to the beach this weekend.",
    "I would like to order a pizza with mushrooms.", "My brother has lost his keys again.",
    "She visits her grandmother every Sunday.", "I need a new pair of shoes.",
    "The shop opens at ten in the morning.", "He is learning to play the piano.",
    "I forgot to buy bread.", "Our flight arrives at six in the evening.",
    "Where is the nearest pharmacy?", "How much does this jacket cost?",
    "The children are playing in the garden.", "Please close the window, it is cold.",
    "I have been living here for five years.", "Can you recommend a good hotel?",
    "The meeting has been moved to Thursday.", "My sister works as a nurse.",
    "We should leave early to avoid the traffic.", "This soup is too salty.",
    "The bus was late this morning.", "I am allergic to peanuts.",
    "Do you know where the station is?", "They bought a house near the river.",
    "It was a beautiful sunny day.", "I will call you after work.",
    "The teacher explained the lesson very clearly.", "Could you speak more slowly, please?",
    "My phone battery is almost empty.", "We had dinner at a small Italian restaurant.",
    "The concert starts at eight o'clock.", "I don't understand this word.",
    "He runs five kilometres every morning.", "The garden is full of flowers in spring.",
    "Can I pay by card?", "My grandparents live in a small village.",
    "The film was longer than I expected.", "Please send me the report by Friday.",
    "I am looking for the post office.", "We need more milk and eggs.",
    "The hotel room has a view of the sea.", "She speaks three languages fluently.",
    "The door is open, come in.", "I have a headache today.",
    "Our cat lies on the sofa all day.", "The exam was easier than last year.",
    "Let's meet in front of the cinema.", "The water in the lake is very clear.",
    "I lost my wallet on the bus.", "The weather will be warm next week.",
)
TRANSLATION_TEMPLATES = (
    "Translate into {language}: \"{sentence}\"",
    "Please translate this sentence into {language}:\n{sentence}",
    "How do you say \"{sentence}\" in {language}?",
    "Translate the following sentence to {language}: \"{sentence}\"",
)
TRANSLATION_LANGUAGES = ("French", "Spanish", "German", "Italian", "Portuguese", "Dutch")


def general_prompt(kind: str, rng: random.Random) -> str:
    """One prompt of `kind` ("code", "explain", "chat" or "translate"), drawn with `rng`."""
    if kind == "code":
        if rng.random() < 0.2:
            name, methods = rng.choice(CODE_CLASSES)
            text = rng.choice(CLASS_TEMPLATES).format(name=name, methods=methods)
        else:
            text = rng.choice(CODE_TEMPLATES).format(task=rng.choice(CODE_TASKS))
        return text + rng.choice(CODE_SUFFIXES)
    if kind == "explain":
        roll = rng.random()
        if roll < 0.5:
            text = rng.choice(EXPLAIN_TEMPLATES).format(concept=rng.choice(EXPLAIN_CONCEPTS))
        elif roll < 0.8:
            text = rng.choice(PROCESS_TEMPLATES).format(process=rng.choice(EXPLAIN_PROCESSES))
        else:
            text = rng.choice(WHY_TEMPLATES).format(why=rng.choice(EXPLAIN_WHY))
        return text + rng.choice(EXPLAIN_SUFFIXES)
    if kind == "chat":
        if rng.random() < 0.4:
            return rng.choice(CHAT_REQUESTS)
        fields = {key: rng.choice(values) for key, values in CHAT_FILLERS.items()}
        return rng.choice(CHAT_TEMPLATES).format(**fields)
    if kind == "translate":
        return rng.choice(TRANSLATION_TEMPLATES).format(
            language=rng.choice(TRANSLATION_LANGUAGES), sentence=rng.choice(TRANSLATION_SENTENCES))
    raise ValueError(f"unknown prompt kind {kind!r}")
