"""A request's `priority` through the openai SDK: the shared server schedules fcfs, so one is a 400."""

import openai
import pytest

from tests.api.helpers import MODEL


def test_a_priority_on_an_fcfs_server_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body={"priority": 3})
    assert e.value.body["param"] == "priority" and "--scheduling-policy priority" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                       extra_body={"priority": "urgent"})
    assert e.value.status_code == 400
    zero = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body={"priority": 0})
    assert zero.choices[0].text is not None
