"""What a conversation needs beyond the model, for every front end (the app's Chat view, ``fleet serve``):
``sources`` grounds a reply in a document collection (the passages that answer the question, put in
the prompt as numbered sources), ``tools`` runs the agentic loop of tool calls between replies.
"""
