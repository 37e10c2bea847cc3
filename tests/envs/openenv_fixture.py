"""Small OpenEnv environments for tests/envs/test_openenv.py: a number-guessing game with a
text action, and one whose action is a JSON object."""

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class GuessAction(Action):
  guess: str


class GuessObservation(Observation):
  hint: str = ""


class GuessEnvironment(Environment):
  """Guess 7: 'higher'/'lower' hints, reward 1 when right, done after it or 3 tries."""

  def __init__(self):
    super().__init__()
    self._state = State(step_count=0)

  def reset(self, seed=None, episode_id=None, **kwargs) -> GuessObservation:
    self._state = State(step_count=0)
    return GuessObservation(hint="Guess a number from 1 to 9.")

  def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
    self._state.step_count += 1
    try:
      value = int(action.guess.strip())
    except ValueError:
      return GuessObservation(hint="a number, please", reward=0.0,
                              done=self._state.step_count >= 3)
    if value == 7:
      return GuessObservation(hint="right", reward=1.0, done=True)
    return GuessObservation(hint="higher" if value < 7 else "lower", reward=0.0,
                            done=self._state.step_count >= 3)

  @property
  def state(self) -> State:
    return self._state


class MoveAction(Action):
  x: int
  y: int


class BoardObservation(Observation):
  position: list[int] = [0, 0]
  goal: list[int] = [2, 1]


class BoardEnvironment(Environment):
  def __init__(self):
    super().__init__()
    self._state = State(step_count=0)

  def reset(self, seed=None, episode_id=None, **kwargs) -> BoardObservation:
    return BoardObservation()

  def step(self, action: MoveAction, timeout_s=None, **kwargs) -> BoardObservation:
    done = [action.x, action.y] == [2, 1]
    return BoardObservation(position=[action.x, action.y], reward=float(done), done=done)

  @property
  def state(self) -> State:
    return self._state


def make_board(row):
  return BoardEnvironment()
