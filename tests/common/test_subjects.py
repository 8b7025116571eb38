from loopline.common.contracts import subjects


def test_deployment_keys_are_subject_safe_and_distinct():
    names = ["HuggingFaceTB/SmolLM2-135M-Instruct", "/data/models/tiny", "a.b", "a-b", "*", ">"]
    keys = [subjects.deployment_key(n) for n in names]
    assert len(set(keys)) == len(keys)
    for key in keys:
        assert key and not any(c in key for c in ".*> /")
    assert subjects.deployment_key("a.b") == subjects.deployment_key("a.b")  # stable
