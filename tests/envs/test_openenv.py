"""OpenEnv environments through ``env.name='openenv:...'`` (``rlx.envs.openenv``), on small
environments built here: the first messages, text and JSON actions, rewards and done, an
invalid action answered and counted, and the whole episode through rlx's ``Episode``."""

import pytest

pytest.importorskip("openenv.core")

from rlx.envs import Episode, Renderer, ToolRunner, load_factory  # noqa: E402
from rlx.models import builtin_tokenizer  # noqa: E402

MODULE = "tests.envs.openenv_fixture"


def test_a_text_action_game_plays_to_its_reward():
  make = load_factory(f"openenv:{MODULE}:GuessEnvironment")
  env = make({"prompt": "Play."})
  assert env.reset() == [{"role": "user", "content": "Play.\n\nGuess a number from 1 to 9."}]
  first = env.step(" 3 ")
  assert first.messages == [{"role": "user", "content": "higher"}] and first.reward == 0.0
  assert not first.done
  last = env.step("7")
  assert last.done and last.reward == 1.0 and last.messages == []


def test_json_actions_and_an_invalid_one():
  env = load_factory(f"openenv:{MODULE}:make_board")({})
  assert env.reset()[0]["content"] == '{"position": [0, 0], "goal": [2, 1]}'
  bad = env.step("go right")
  assert not bad.done and bad.info == {"malformed_calls": 1}
  assert "not a valid action" in bad.messages[0]["content"]
  moved = env.step('{"x": 1, "y": 1}')
  assert '"position": [1, 1]' in moved.messages[0]["content"] and not moved.done
  assert env.step('{"x": 2, "y": 1}').reward == 1.0


def test_an_openenv_episode_through_the_harness_counts_its_malformed_turns():
  tokenizer = builtin_tokenizer()
  env = load_factory(f"openenv:{MODULE}:make_board")({"prompt": "Reach the goal."})
  episode = Episode(env, Renderer(tokenizer, "builtin"), ToolRunner(num_workers=0), None,
                    format="builtin", max_turns=4)
  prompt = episode.start()
  assert tokenizer.decode(prompt).startswith("Reach the goal.")
  reply = episode.respond("left?", "stop")
  assert not reply.done and tokenizer.decode(reply.tokens).strip().startswith("That is not")
  assert episode.respond('{"x": 2, "y": 1}', "stop").done
  assert episode.reward == 1.0 and episode.counts["malformed_calls"] == 1


def test_a_missing_environment_is_named():
  with pytest.raises(ValueError, match="OpenEnv environment"):
    load_factory(f"openenv:{MODULE}:Nowhere")
