from grpo_vision.cli.main import main

main()
