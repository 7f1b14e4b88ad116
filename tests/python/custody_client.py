"""What the client scripts share: the official client pointed at the server under test
(CUSTODY_URL, CUSTODY_KEY, CUSTODY_MODEL_ID) and `check`, which raises with the reason."""
import os

from openai import OpenAI

URL = os.environ["CUSTODY_URL"]
KEY = os.environ["CUSTODY_KEY"]
MODEL = os.environ["CUSTODY_MODEL_ID"]
client = OpenAI(base_url=URL + "/v1", api_key=KEY, max_retries=0, timeout=600)


def check(cond, what):
    if not cond:
        raise AssertionError(what)
