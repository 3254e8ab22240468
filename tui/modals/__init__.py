"""The chat's modal dialogs, one module each: model picker, chat settings, speculation, help, and
the small prompt / confirm dialogs. `base` holds what they share."""
