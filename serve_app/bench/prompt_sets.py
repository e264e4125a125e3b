"""Named prompt sets, each with one job, kept apart so no figure is measured on its own training data.

- PROFILE_PROMPTS: what `specserve profile` measures latency and acceptance on. A profile's acceptance
  steers lut and adaptive, so it must not be measured on the prompts those policies are judged on.
- Evaluation sets (EVAL_SETS): BENCH_PROMPTS (everyday chat), CREATIVE_PROMPTS (unusual requests, the
  draft agrees less), STRUCTURED_PROMPTS (lists, code edits, rewrites: answers that repeat or follow
  the request's own text, the draft agrees more) and REWRITE_PROMPTS (paragraphs to correct or edit and
  return whole: answers that copy most of their prompt). The benchmarks run on these only.
- Distillation's seed prompts (`distill.seed_prompts`, templates x topics) are the training set.

tests/test_prompt_sets.py asserts the sets are pairwise disjoint and that no profile or evaluation
prompt is an instance of a distillation template (not just a different string of the same kind).
"""

from __future__ import annotations

from serve_app.prompts import encode_chat

BENCH_PROMPTS = [
    "Explain why the sky is blue in two short paragraphs.",
    "Implement a palindrome check in Python and explain it briefly.",
    "List five tips for staying focused while studying.",
    "Tell a short story about a robot who learns to paint.",
    "What is the difference between a list and a tuple in Python?",
    "Summarize the water cycle for a ten-year-old.",
    "Give me a recipe for a simple tomato soup.",
    "Describe the rules of chess in a few sentences.",
    "Compose a haiku about falling autumn leaves.",
    "How does a bicycle stay upright while moving?",
    "Compare cats and dogs as pets.",
    "Explain what a hash table is and when to use one.",
    "Write a polite email asking a colleague for a meeting.",
    "What are the main causes of inflation?",
    "Describe a sunset over the ocean.",
    "Give three arguments for learning a second language.",
]
"""Everyday chat requests: bench engine, bench http, bench policies (a) and (b), bench acceptance."""

MORE_CHAT_PROMPTS = [
    "What should I look for when adopting a rescue dog?",
    "Plan a two-day trip to Kyoto on a small budget.",
    "Why do onions make people cry when they are cut?",
    "What should I check before buying a used car?",
    "How can I politely decline an invitation to a party?",
    "What makes sourdough bread different from ordinary bread?",
    "Explain the offside rule in football as simply as you can.",
    "How does a microwave oven heat food?",
    "Write a short apology to a friend for missing their birthday dinner.",
    "Why is Venus hotter than Mercury?",
    "How do I get started with running if I have never exercised?",
    "Why is the ocean salty but rivers are not?",
    "Write a Python snippet that counts how often each letter appears in a string.",
    "How often should I water a cactus, and why?",
    "What is the difference between a stock and a bond?",
    "Why do leaves change colour in the autumn?",
    "Plan a simple vegetarian dinner for four people.",
    "What does a product manager do all day?",
    "How does a submarine dive and surface?",
    "How do I ask my manager for a raise?",
    "What is the difference between RAM and storage in a computer?",
    "Which board games work well for a family with young children?",
    "How do time zones work, and who decides them?",
    "Write a JavaScript function that shuffles an array.",
    "How can I make my apartment warmer in winter without raising the bill?",
    "How does a lock and key actually work?",
    "Describe how to change a flat tyre on a bicycle.",
    "What are the signs that a person is dehydrated?",
    "How do I write a good cover letter for an internship?",
    "Why does ice float on water?",
    "Recommend a few classic novels for someone who likes mysteries.",
    "What is the purpose of a central bank?",
    "How can I improve my handwriting as an adult?",
    "What is a spreadsheet pivot table, and when is it useful?",
    "What causes earthquakes, and why are some regions more at risk?",
    "How do I make a budget for my monthly expenses?",
    "What happens in the body when we sleep?",
    "Why do cats knock things off tables?",
    "How do solar panels turn sunlight into electricity?",
    "Write a SQL query that finds the ten customers with the most orders.",
    "What are good questions to ask at the end of a job interview?",
    "How did the printing press change Europe?",
    "What is the best way to learn to touch type?",
    "Why do some people get seasick and others do not?",
    "How do volcanoes form?",
    "How do I clean a cast iron pan without ruining it?",
    "What is the difference between a crocodile and an alligator?",
    "Give me a short pep talk before an exam.",
]
"""More everyday chat requests, for the peer benchmark: with BENCH_PROMPTS, one distinct prompt per request a
server answers at 1, 8 and 32 in flight (an answer seen before would be drafted from the history, which vLLM
cannot do). Not among EVAL_SETS (bench acceptance's sets); held out of the distillation corpus like them."""

CREATIVE_PROMPTS = [
    "Invent a new holiday and describe how people celebrate it.",
    "Write a short poem about a lonely lighthouse in a storm.",
    "Describe the taste of a fruit that does not exist.",
    "Tell a story about a clock that runs backwards.",
    "Imagine a city built inside a giant tree. What is daily life like?",
    "Write a letter from a cat to its owner complaining about Mondays.",
    "Describe a dream you might have after reading about the ocean.",
    "Create a myth that explains why the stars twinkle.",
]
"""Unusual requests, unlike anything the draft was distilled on: the draft agrees less."""

STRUCTURED_PROMPTS = [
    "Rewrite this sentence in the passive voice: The committee approved the new budget on Tuesday.",
    "Fix the bug in this Python function and show the corrected code:\n\ndef average(xs):\n"
    "    total = 0\n    for x in xs:\n        total += x\n    return total / len(x)",
    "Turn this shopping list into a numbered list: apples, bread, milk, eggs, cheese, rice, onions.",
    "Rename the variable n to count in this code and return the whole code:\n\nn = 0\nfor line in open('log.txt'):\n"
    "    if 'ERROR' in line:\n        n += 1\nprint(n)",
    "Sort these words alphabetically, one per line: pear, banana, cherry, apple, mango, grape, kiwi.",
    "Convert these field names to snake_case: firstName, lastName, dateOfBirth, emailAddress, phoneNumber.",
    "Turn this paragraph into three bullet points: Our team moved to a new office in March. The new office "
    "is closer to the train station. Everyone now has a standing desk.",
    "Add type hints to this Python function:\n\ndef scale(values, factor):\n    return [v * factor for v in values]",
    "Convert this JSON to YAML: {\"name\": \"Ada\", \"age\": 36, \"languages\": [\"English\", \"French\"], \"active\": true}",
    "Make a markdown table of the days of the week with their three-letter abbreviations.",
    "Correct the spelling in this text: Yesterday I recieved a pacakge with a beatiful blue vase and a "
    "handwriten note.",
    "Rewrite this message so it sounds more formal: hey, can u send me the report by friday? thx",
    "Write a Python dictionary mapping each month name to its number of days in a non-leap year.",
    "Rewrite this JavaScript function with arrow syntax: function add(a, b) { return a + b; }",
    "Give the plural of each word, one per line: cat, box, child, mouse, leaf, bus, tooth.",
    "Repeat this list in reverse order: red, orange, yellow, green, blue, indigo, violet.",
]
"""Lists, code edits, rewrites written for evaluation: answers that copy or follow the request's text."""

REWRITE_PROMPTS = [
    "Fix the spelling mistakes in this paragraph and return the whole corrected paragraph:\n\nThe museum opens "
    "at ten in the morning and closes at five in the afternoon. Tickets cost twelve dollars for adults and are "
    "free for childern under six. The new exhibit on ancient Egypt is on the thrid floor, and guided tours leave "
    "from the main hall every hour. Photography is alowed everywhere except in the special exhibition rooms.",
    "Correct the typos in this text and give back the full corrected text:\n\nOur bakery uses only fresh "
    "ingredients. Every mornning we bake bread, croissants and muffins before the sun comes up. On weekends we "
    "also make cinammon rolls and apple pie. Orders for birthday cakes should be placed at least three days in "
    "advance, and we can make them without gluten or nuts on request.",
    "Return this paragraph with its spelling errors fixed and nothing else changed:\n\nThe hiking trail starts "
    "at the parking lot near the lake and climbs slowly through a pine forest. After about two miles it reaches "
    "a wooden bridge over a small river. From there the path becomes steep and rocky, so good shoes are "
    "nesessary. At the top, hikers can see the whole valley and, on clear days, the distant mountians.",
    "Fix the spelling in this note and return the complete note:\n\nDear neighbours, the water in our building "
    "will be turned off on Thursday from nine until noon while the plumbers replace the old pipes in the "
    "basement. Please fill a few bottles the night before. We apologise for the inconvenience and thank you for "
    "your paitence. If you have any questions, call the building manager at the usual number.",
    "Replace every occurrence of the word 'car' with 'vehicle' in this text and return the whole text:\n\nThe "
    "car must be parked in the marked spaces only. A car left in the loading zone for more than ten minutes "
    "will be towed. Each resident may register one car with the office, and visitors must leave their car in "
    "the guest area near the main gate.",
    "Change every 'Monday' to 'Tuesday' in this schedule and return the full schedule:\n\nThe team meeting is "
    "on Monday at nine. Reports are due on Monday before noon. The cleaning crew comes every Monday evening, and "
    "the library closes early on Monday. Please plan your week around Monday.",
    "Fix the grammar and spelling in this email and return the corrected email:\n\nHello Maria, thank you for "
    "you message. I have read the report and I think it look very good. There is only one small mistake in the "
    "second table, were the totals do not add up. Could you check it before friday? After that we can send it "
    "to the client. Best regards, Tom",
    "Correct the spelling in this product description and return all of it:\n\nThis lightweight backpack is "
    "made from waterproof fabric and has two large compartments, a padded laptop sleeve and four side pockets. "
    "The shoulder straps are adjustable and very confortable, even on long walks. It comes in black, grey and "
    "dark blue, and every bag has a lifetime waranty against defects.",
    "Rewrite this code with the variable 'temp' renamed to 'celsius', returning all of the code:\n\n"
    "def describe(temp):\n    if temp < 0:\n        return 'freezing'\n    if temp < 15:\n        return 'cold'\n"
    "    if temp < 25:\n        return 'mild'\n    return 'hot'\n\nfor temp in [-5, 10, 20, 30]:\n"
    "    print(temp, describe(temp))",
    "Fix the spelling mistakes in this story and return the whole story:\n\nOnce upon a time a little fox lived "
    "at the edge of a large forest. Every evening she walked to the river to drink and to watch the fish jump. "
    "One day she found a lost duckling crying under a bush. The fox was hungry, but she decided to help the "
    "duckling find its mother, and the two became unlikley freinds.",
    "Return this list of instructions with the typos corrected:\n\n1. Preheat the oven to two hundred degrees.\n"
    "2. Mix the flour, sugar and butter in a large bowl.\n3. Add the eggs one at a time and stir well.\n"
    "4. Pour the batter into a greased tin.\n5. Bake for fourty minutes, untill golden brown.\n"
    "6. Let it cool before serveing.",
    "Correct the spelling in this announcement and return it in full:\n\nThe city swimming pool will reopen "
    "next month after six months of repairs. The changing rooms have been renovated and a new childrens pool "
    "has been added. Opening hours will be from seven in the morning to nine at night, and season tickets can "
    "be bought online or at the entrence.",
]
"""Rewrites that copy most of their prompt (typo fixes, word swaps, a rename): prompt lookup's workload."""

PROFILE_PROMPTS = [
    "How do airplanes generate lift?",
    "Suggest a weekend itinerary for a first visit to a big city.",
    "What should I pack for a three-day hiking trip?",
    "Explain the difference between weather and climate.",
    "Tell me about the life cycle of a frog.",
    "How can I make my morning routine more productive?",
    "Describe how a refrigerator keeps food cold.",
    "What are good habits for writing clean code?",
    "Explain compound interest with a small example.",
    "Why do dogs tilt their heads when we talk to them?",
    "Give advice to someone starting their first job.",
    "How does a search engine decide which pages to show?",
    "Describe the smell of a forest after rain.",
    "What is the role of a referee in a football match?",
    "Explain how vaccines train the immune system in simple terms.",
    "Recommend three ways to reduce food waste at home.",
    "How does a thermostat work?",
    "Tell a bedtime story about a sleepy owl.",
    "What makes a good team leader?",
    "Explain what an API is to a non-programmer.",
    "Why do we have leap years?",
    "Describe a busy market on a Saturday morning.",
    "How do noise-cancelling headphones block out the sound of an engine?",
    "What are the benefits of reading fiction?",
    "Explain recursion using a real-world analogy.",
    "How should I prepare for a long flight?",
    "What causes the seasons on Earth?",
    "Write a short thank-you note to a neighbour who watered my plants.",
    "How do bees make honey?",
    "Give tips for taking better photos with a phone.",
    "Why do antibiotics not work against a cold?",
    "Describe how bread rises.",
]
"""Profiling only (latency grid rows up to batch 32, acceptance per draft position)."""

EVAL_SETS = {"benchmark": BENCH_PROMPTS, "creative": CREATIVE_PROMPTS, "structured": STRUCTURED_PROMPTS,
             "rewrite": REWRITE_PROMPTS}


def chat_prompts(tokenizer, texts: list[str], n: int | None = None) -> list[list[int]]:
    """Token ids of the first n texts as single-turn chats (cycled if n exceeds the set)."""
    n = len(texts) if n is None else n
    return [encode_chat(tokenizer, [{"role": "user", "content": texts[i % len(texts)]}]) for i in range(n)]
