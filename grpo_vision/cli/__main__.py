from grpo_vision.cli.app import main

main()
