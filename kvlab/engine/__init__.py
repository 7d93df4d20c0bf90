"""The engine room: the step loop and request API (`LLMEngine`), the scheduler, the model runner and the
attention it calls. It builds on the cache (`kvlab.cache`), the policies' runtime (`kvlab.policies`) and
speculation (`kvlab.speculation`); nothing below it imports it."""
