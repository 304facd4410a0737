"""The paper's worked example: 3 houses; Alice, Bob, Carol; cat, dog, fish; tea, coffee, juice.

Clues 1-3 are the paper's ("Alice lives directly left of the cat owner", "Bob lives in the tea
house", "house 2 drinks tea"); clues 4-5 complete them to a unique solution: Alice 1 dog coffee,
Bob 2 cat tea, Carol 3 fish juice.
"""
NAMES, PETS, DRINKS = ["Alice", "Bob", "Carol"], ["cat", "dog", "fish"], ["tea", "coffee", "juice"]
THEORY = {
    "sorts": {"House": [1, 2, 3], "Name": NAMES, "Pet": PETS, "Drink": DRINKS},
    "consts": {s: "Int" for s in NAMES + PETS + DRINKS},
    "preds": {},
    "domain": ["(forall ((x Name)) (<= 1 x 3))", "(forall ((x Pet)) (<= 1 x 3))",
               "(forall ((x Drink)) (<= 1 x 3))", "(distinct Alice Bob Carol)",
               "(distinct cat dog fish)", "(distinct tea coffee juice)"],
}
PREMISES = """(assert (= (+ Alice 1) cat))   ; clue 1
(assert (= Bob tea))           ; clue 2
(assert (= tea 2))             ; clue 3
(assert (= Carol juice))       ; clue 4
(assert (distinct fish 1))     ; clue 5
"""
STEPS = """By clues 2 and 3, Bob lives in house 2.
(step 1 (= Bob 2))
Alice is directly left of the cat owner, so Alice is not in house 3.
(step 2 (not (= Alice 3)))
House 2 is not house 1.
(step 3 (not (= 2 1)))
Bob drinks coffee.
(step 4 (= Bob coffee))
"""
SOLUTION = {"House 1": {"Name": "Alice", "Pet": "dog", "Drink": "coffee"},
            "House 2": {"Name": "Bob", "Pet": "cat", "Drink": "tea"},
            "House 3": {"Name": "Carol", "Pet": "fish", "Drink": "juice"}}


def record(answer: str) -> dict:
    """A zebra task record of the example with gold answer `answer`."""
    attributes = {"Name": sorted(NAMES), "Pet": sorted(PETS), "Drink": sorted(DRINKS)}
    return {"id": "zebra-worked", "task": "zebra", "split": "test",
            "messages": [{"role": "user", "content": "the worked example"}], "answer": answer,
            "verifier": {"kind": "zebra", "attributes": attributes, "symbols": attributes,
                         "theory": THEORY},
            "metadata": {}}
